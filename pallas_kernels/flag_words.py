"""Values that carry their own flags (NCCL's LL protocol), for rows with one writer that other CTAs of the same
persistent kernel read without a grid barrier between them.

A word is 8 bytes: an f32's bits, then a u32 flag. The writer stores each value with its flag in one strong
store (``st.relaxed.gpu``; two adjacent words in one ``.v2.b64`` store, each element of which is one 64-bit
access), which a reader sees whole or not at all. The reader issues all its loads at once (``ld.relaxed.gpu``:
strong, so a poll never spins on a stale L1 line), then checks their flags and loads again only while one is
not the flag it expects. So the values need no release by their writer (its MEMBAR, ~0.7 µs at a grid barrier:
docs/decode_step_kernel.md), no count to poll, and no second round trip to fetch them.

A flag names the layer (``layer + 1``): rows rewritten every layer need no reset, since a layer's readers are
past the grid barriers that end it before the next layer's writers begin. The words live in the kernel's global
scratch (``words``: semaphores to Pallas), which JAX zeroes before every call; were that scratch to persist from
call to call instead, every word an earlier call wrote would hold that call's last layer's flag, which only the
last layer of a call expects, and it reads words that its own call's earlier layers rewrote. So a kernel of two
or more layers is right either way (``decode_step_attention.FLAGGED_STATES`` asks for two).

Not interpretable (``inline_mgpu``): the kernels that use it are grid-barrier kernels, which run on the GPU
only."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector of per-row values, as the warpgroup's wgmma rows hold them
WARPGROUP = 128  # threads
# Nanoseconds a reader sleeps (``nanosleep``) before it loads stale words again (0: none), so that many readers
# polling the same lines leave the L2 slices that hold them to their writers. Read at trace time.
BACKOFF_NS = 0
# A diagnostic, never set outside benchmarks: readers take their first loads as they are, unchecked (values
# wrong where a word was stale): the step's time without the polls' cost. Read at trace time.
PROBE_NO_POLL = False
# A diagnostic, never set outside benchmarks: the words' stores and first loads weak (``st.global`` /
# ``ld.global``) instead of strong: what the strong accesses cost. Read at trace time.
PROBE_WEAK = False


def words(shape: tuple[int, ...]):
    """Global scratch for flagged words of values of ``shape``: i32[*shape, 2] (a value's bits, its flag), zeroed
    before the call. A kernel allocates its flagged words before any other ``pl.get_global``: semaphores are 4
    bytes and the words 8, stored in pairs of 16, so an array's offset must be a multiple of 4 semaphores (each
    array after the first then needs the ones before it to be multiples of 4 semaphores too)."""
    return pl.get_global(plgpu.SemaphoreType.REGULAR((*shape, 2)))


def _i32():
    return ir.IntegerType.get_signless(32)


def _i64():
    return ir.IntegerType.get_signless(64)


def _strong() -> str:
    """The words' accesses' qualifier: relaxed at the GPU's scope (weak under ``PROBE_WEAK``)."""
    return "" if PROBE_WEAK else ".relaxed.gpu"


def _word_ptr(ref, index):
    """The address of the word at ``index`` (index values, or ints) of ``ref`` i32[..., 2]."""
    return mgpu_utils.memref_ptr(mgpu_utils.memref_slice(ref, (*index, 0)))


def _word(value, flag):
    """An f32 and an i32 flag -> the i64 word (value bits low, flag high)."""
    bits = arith.extui(_i64(), arith.bitcast(_i32(), value))
    return arith.ori(bits, arith.shli(arith.extui(_i64(), flag), arith.constant(_i64(), 32)))


def _register_offsets(layout, shape) -> list[tuple[int, ...]]:
    """The index offsets of a thread's registers' first elements from its first register's, as ``thread_idxs``
    builds them (its per-thread part plus a constant a register), for layouts whose per-thread part never carries
    into the next row: the row layout ``ROW`` and WGMMA's on [64, N] (a thread's columns 2 (lane % 4) + 8 j)."""
    mgpu_layout = layout.to_mgpu()
    if mgpu_layout != mgpu_fa.WGMMA_LAYOUT and mgpu_layout != ROW.to_mgpu():
        raise NotImplementedError(f"flag_words: registers' offsets in {mgpu_layout}")
    contig = mgpu_utils.get_contiguous_strides(shape)
    tile_strides = mgpu_layout.tiling.tile_strides(contig)
    linear = [sum(i * s for i, s in zip(tile_idx, tile_strides)) for tile_idx in np.ndindex(
        mgpu_layout.registers_shape(shape))]
    offsets = []
    for lin in linear:
        idx = []
        for stride in contig:
            idx.append(lin // stride)
            lin %= stride
        offsets.append(tuple(idx))
    return offsets


def store(pairs, flag):
    """Each (values, ref) of ``pairs`` stored with ``flag`` (an i32 scalar, at least 1): values f32 [64, N] in
    the WGMMA layout into ref i32[64, N, 2], or [64] in ``ROW`` into ref i32[64, 2]; by every thread of the
    warpgroup, its own values (a row's replicas store the same word), each value's word at its first register's
    address plus a constant (one pointer a ref: few instructions beside the stores themselves)."""
    layouts = tuple(plgpu.Layout.WGMMA if len(values.shape) == 2 else ROW for values, _ in pairs)
    offsets = [_register_offsets(layout, values.shape) for (values, _), layout in zip(pairs, layouts)]

    @plgpu.inline_mgpu(arg_types=(tuple((layout, plgpu.RefType()) for layout in layouts),
                                  plgpu.Layout.WG_SPLAT(())))
    def body(_, pairs, flag):
        flag = flag.registers.item()
        for (values, ref), at in zip(pairs, offsets):
            strides = [s * 4 for s in ir.MemRefType(ref.type).get_strides_and_offset()[0][:-1]]
            base = _word_ptr(ref, next(iter(values.layout.thread_idxs(values.shape))))
            for offset, reg in zip(at, values.registers.flat):
                vec = ir.VectorType(reg.type).shape[0]
                packed = [_word(llvm.extractelement(reg, arith.constant(_i32(), k)), flag) for k in range(vec)]
                for k in range(0, vec, 2):
                    byte = sum(o * s for o, s in zip(offset, strides)) + k * strides[-1]
                    if k + 1 < vec:
                        mgpu_utils.inline_ptx(f"st{_strong()}.global.v2.b64 [$0+{byte}], {{$1, $2}};", base,
                                              packed[k], packed[k + 1], has_side_effects=True)
                    else:
                        mgpu_utils.inline_ptx(f"st{_strong()}.global.b64 [$0+{byte}], $1;", base, packed[k],
                                              has_side_effects=True)

    layouts_cast = tuple((plgpu.layout_cast(values, layout), ref) for (values, ref), layout in zip(pairs, layouts))
    body(layouts_cast, jnp.asarray(flag, jnp.int32))


def _checked(ptrs, at, loaded, flag):
    """The words at ``at`` ((index into ``ptrs``, byte offset) each; ``loaded``: their first loads) once every
    flag is ``flag``: their values' bits (i32), loading the stale ones again (after ``BACKOFF_NS``) while any is
    (one inline PTX block: its own loop and labels). A pointer and immediate offsets a ref, so that a poll keeps
    few registers live while it waits."""
    n, k = len(at), len(ptrs)
    if PROBE_NO_POLL:
        return [arith.trunci(_i32(), w) for w in loaded]
    lines = [".reg .pred any;", f".reg .pred stale<{n}>;", ".reg .b32 hi;", f".reg .b64 w<{n}>;"]
    lines += [f"mov.b64 w{i}, ${n + i};" for i in range(n)]
    lines.append("again:")
    for i in range(n):
        lines.append(f"mov.b64 {{${i}, hi}}, w{i};")
        lines.append(f"setp.ne.u32 stale{i}, hi, ${2 * n + k};")
    lines += [f"or.pred any, stale0, stale{i};" if i == 1 else f"or.pred any, any, stale{i};" for i in range(1, n)]
    lines.append("@!any bra done;" if n > 1 else "@!stale0 bra done;")
    if BACKOFF_NS:
        lines.append(f"nanosleep.u32 {int(BACKOFF_NS)};")
    lines += [f"@stale{i} ld.relaxed.gpu.global.b64 w{i}, [${2 * n + p}+{offset}];"
              for i, (p, offset) in enumerate(at)]
    lines += ["bra again;", "done:"]
    out = mgpu_utils.inline_ptx("{\n" + "\n".join(lines) + "\n}", *loaded, *ptrs, flag,
                                result_types=[_i32()] * n, has_side_effects=True)
    return list(out)


def load_words(groups, flag, shape: tuple[int, ...]):
    """The flagged values of ``groups`` (lists of refs i32[R, 2] of R words) once each carries ``flag`` (an i32
    scalar) -> the outputs in order: a ref of as many words as ``shape`` has values (a multiple of the warpgroup's
    128 threads) one f32 array of ``shape`` in the strided layout (thread t's words t, t + 128, ...), a smaller ref
    an f32 scalar a word (every thread loads it). Every word's first load is issued before any is checked (one
    round trip for them all), then a group's words are checked together and loaded again while any is stale (the
    writer's store not yet seen): one pointer a ref, the words at immediate offsets from it."""
    size = int(np.prod(shape))
    refs = [ref for group in groups for ref in group]
    misfit = lambda ref: len(ref.shape) != 2 or ref.shape[1] != 2 or ref.shape[0] > size or (
        ref.shape[0] >= WARPGROUP and ref.shape[0] != size)
    if size % WARPGROUP or (bad := [ref.shape for ref in refs if misfit(ref)]):
        raise ValueError(f"flag_words.load_words: shape {shape}, refs {[r.shape for r in refs]}; accepted: a "
                         f"shape of a multiple of {WARPGROUP} values, refs [R, 2] of that many words or under "
                         f"{WARPGROUP}" + (f" (not {bad})" if size % WARPGROUP == 0 else ""))
    strided = plgpu.Layout.WG_STRIDED(shape, vec_size=1)
    scalar = plgpu.Layout.WG_SPLAT(())
    kinds = [ref.shape[0] == size for ref in refs]  # an array, else scalars
    returns = [plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=strided) if array else
               plgpu.ShapeDtypeStruct((), jnp.float32, layout=scalar) for array, ref in zip(kinds, refs)
               for _ in range(1 if array else ref.shape[0])]

    @plgpu.inline_mgpu(arg_types=(tuple(plgpu.RefType() for _ in refs), scalar), return_type=returns)
    def body(_, refs, flag):
        flag = flag.registers.item()
        layout = strided.to_mgpu()
        f32 = ir.F32Type.get()
        first = next(iter(layout.thread_idxs(shape)))  # the thread's first value's index in ``shape``
        thread_word = mgpu_utils.dyn_dot(first, [arith.constant(ir.IndexType.get(), s)
                                                 for s in mgpu_utils.get_contiguous_strides(shape)])
        ptrs, offsets = [], []  # a ref's pointer; its words as byte offsets from it, in its outputs' order
        for ref, array in zip(refs, kinds):
            row_bytes = ir.MemRefType(ref.type).get_strides_and_offset()[0][0] * 4
            if array:
                ptrs.append(_word_ptr(ref, (thread_word,)))
                offsets.append([j * WARPGROUP * row_bytes for j in range(size // WARPGROUP)])
            else:
                ptrs.append(mgpu_utils.memref_ptr(ref))
                offsets.append([j * row_bytes for j in range(ir.MemRefType(ref.type).shape[0])])
        loaded = [[mgpu_utils.inline_ptx(f"ld{_strong()}.global.b64 $0, [$1+{offset}];", p, result_types=_i64(),
                                         has_side_effects=True) for offset in at] for p, at in zip(ptrs, offsets)]
        out, start = [], 0
        for group in groups:
            end = start + len(group)
            values = iter(_checked(ptrs[start:end], [(i, o) for i, at in enumerate(offsets[start:end]) for o in at],
                                   [w for at in loaded[start:end] for w in at], flag))
            for array, at in zip(kinds[start:end], offsets[start:end]):
                bits = [arith.bitcast(f32, next(values)) for _ in at]
                if array:
                    registers = np.array([vector.broadcast(ir.VectorType.get((1,), f32), b) for b in bits],
                                         dtype=object).reshape(layout.registers_shape(shape))
                    out.append(mgpu_fa.FragmentedArray(_registers=registers, _layout=layout, _is_signed=None))
                else:
                    out += [mgpu_fa.FragmentedArray.splat(b, ()) for b in bits]
            start = end
        return out

    return body(tuple(refs), jnp.asarray(flag, jnp.int32))
