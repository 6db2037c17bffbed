"""Batch-1 decode phases inside one persistent Mosaic GPU kernel: the shared machinery and the GEMV chain.

Why: a batch-1 decode layer of V2-Lite is ~13 dependent launches, ~77 µs for ~167 MB of weights that
the H200 streams in ~40 µs; each launch costs ~2 µs beyond its bytes inside XLA's CUDA graphs
(decode_profile.md rounds 10-20). ``benchmarks/megakernel_probe.py`` ran the layer's schedule in one
kernel of 132 CTAs: one TMA stream of 16 KiB boxes a CTA across phases and layers, a grid barrier
after each phase, stand-in products: 42.2 µs a layer once a producer warpgroup issues the copies and
each box's products are two independent wgmma chains with two boxes in flight (round 20). The step
kernel is built from phases of that shape, each checked on its own: this module holds the machinery they
share (SM count, grid barriers, token tiles) and the GEMV phase; ``decode_step_moe`` the expert phase and
the MoE half of a layer. The plan for the whole kernel: ``docs/decode_step_kernel.md``.

``gemv_chain``: x_{l+1} = bf16(x_l @ W_l) for l < L, all L in one kernel, as a chain of dependent
GEMV phases (o_proj-like: D x D weights, one token):

- CTA c owns one (64-column tile, K range of ``UNIT_K`` rows) unit of every layer: D / 64 tiles x
  D / UNIT_K ranges (128 CTAs at D = 2048). Its boxes are [128 rows, 64 columns] of W_l as two [64, 64]
  halves, the expert launch's boxes.
- Warpgroup 1 streams the CTA's boxes of every layer in order through a ring of ``RING`` slots, each
  refilled as soon as the products free it; weights do not depend on activations, so the stream runs
  ahead across the barriers.
- Warpgroup 0 multiplies: [64 columns, 8] += half^T x the input's [8, 64] tile (first row the input,
  as bf16), each half into its own accumulator (two chains), the previous box's slot freed once the
  current box's products are issued. Its column sums (the token's 64 partial outputs) go to layer l's
  f32 output row by a TMA store that adds (split-K without another launch).
- A grid barrier (a global semaphore counting arrivals) then orders layer l's sums before any CTA
  reads its K range of them back (TMA) as the next layer's tiles.

The output rows start at zero: the CTAs zero them by TMA at the start, behind one more barrier.

Measured on the H200 (``python -m benchmarks.megakernel_probe --gemv-chain``, 26 layers of 2048 x 2048,
2026-12-02, ``gemv_chain_h200.json``, ``gemv_chain_partials_h200.json``): 4.1 µs a layer against 8.0 for
a Triton ``stacked_gemv`` launch a layer (its split-K sum and rounding included) and 14.0 for XLA's dot.
A phase is latency-bound: the trace (``--trace``) has the wait for the TMA add to complete before the
barrier as its largest part. Storing each split's partial row from registers instead, its reader adding
the splits, was slower (5.0 µs; code in git e61fb21).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import why_not_hopper

HALF = 64  # a box is two [64, 64] halves of bf16: rows of K, columns of N
STEP = 2 * HALF  # K rows a box holds
TOKEN_N = 8  # the products' N: the input as the first row of an [8, 64] tile
UNIT_K = 512  # K rows a CTA owns of its column tile (4 boxes at 16 KiB)
RING = 9  # 16 KiB boxes in flight a CTA (read at trace time; megakernel_probe: 8 beat 12; round 45: 9 beat 8)
NUM_SMS = 132  # an H200's SMs: every CTA of a persistent kernel must be resident at once
_TILING = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# A diagnostic, never set outside benchmarks: the names of the grid barriers (``_arrive_and_wait``'s ``name``:
# "phase1" .. "phase4" after the attention phases, "o_proj" after o_proj, "layer" after the MoE half) at which
# every CTA arrives but does not wait. The kernel then reads rows before they are complete: its results are
# wrong (NaN possible), its work the same, except that the MoE half may route wrong values to repeated experts
# and read fewer bytes. So the step's time without a barrier is an upper bound on what gating that boundary on
# its producers alone could save (``benchmarks.step_profile --variant``). H200, batch 1 (decode_profile.md round
# 39): 0.57-0.93 µs a layer each, 4.7 for all six. Read at trace time.
PROBE_NO_WAIT: tuple = ()
# A diagnostic, never set outside benchmarks (round 45): the grid barriers (names as above) whose arrivals are relaxed
# adds instead of releases (no MEMBAR; readers may then see the count before the rows: values wrong). With
# PROBE_NO_WAIT naming the same barriers, the step's time bounds what flags inside the rows could save there
# (docs/decode_step_kernel.md). Read at trace time.
PROBE_RELAXED_AT: tuple = ()
BARRIER_NAMES = ("phase1", "phase2", "phase3", "phase4", "o_proj", "layer")


def num_sms() -> int:
    """The SMs of the GPU these kernels run on: all of a persistent kernel's CTAs must be resident at once
    (one an SM), or its grid barriers never open. Off the GPU (lowering for an abstract H200), the H200's."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", None) or NUM_SMS) if device.platform == "gpu" else NUM_SMS


def supports(depth: int, num_layers: int, dtype) -> str | None:
    """None when ``gemv_chain`` takes [L, D, D] weights, else why not."""
    if why_not := why_not_hopper():
        return why_not
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return f"weights in {jnp.dtype(dtype).name} (this kernel takes bfloat16)"
    if depth % UNIT_K:
        return f"depth {depth} is not a multiple of {UNIT_K}"
    if (ctas := _ctas(depth)) > num_sms():
        return f"depth {depth} needs {ctas} CTAs resident at once (this GPU has {num_sms()} SMs)"
    if num_layers < 1:
        return f"{num_layers} layers (at least 1)"
    return None


def _ctas(depth: int) -> int:
    return depth // HALF * (depth // UNIT_K)


@plgpu.inline_mgpu()
def proxy_fence(_):
    """Orders this thread's generic-proxy accesses of global memory with its TMA (async-proxy) ones: rows a
    TMA store wrote before a release, rows a TMA load reads after an acquire."""
    mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)


def _issue_box(ring, full, free, n, copies):
    """A producer's box at ring position n, once the slot is free: half h from the view of each (gmem view,
    condition) pair of ``copies(h)`` whose condition holds (a Python True: always; at most one should)."""
    slot = lax.rem(n, RING)
    pl.when(n >= RING)(lambda: plgpu.barrier_wait(free.at[slot]))

    def half(h, _=None):
        for view, when in copies(h):
            pl.when(when)(lambda view=view: plgpu.copy_gmem_to_smem(view, ring.at[slot, h], full.at[slot]))

    lax.fori_loop(0, 2, half, None)  # a loop, not unrolled: machine code is a budget (decode_profile.md round 28)


def _unit_boxes(ring, full, free, n, weight, tile, kq):
    """A GEMV unit's boxes at ring positions n, n + 1, ...: K rows [kq * UNIT_K, (kq + 1) * UNIT_K) of
    ``weight`` (one layer's [K, N] in global memory), its columns [tile * 64, tile * 64 + 64)."""
    lax.fori_loop(0, UNIT_K // STEP, lambda i, _: _issue_box(ring, full, free, n + i, lambda h: [
        (weight.at[pl.ds(kq * UNIT_K + i * STEP + h * HALF, HALF), pl.ds(tile * HALF, HALF)], True)]), None)


def _unit_store(ring, full, free, tiles_smem, n, zeros, part_smem, out_row):
    """A GEMV unit's products (its boxes at ring positions n, ..., ``_unit_boxes``; its K range's tiles first in
    tiles_smem), its 64 partial sums added by TMA into ``out_row`` (f32[64] in global memory)."""
    part_smem[...] = _unit_sums(ring, full, free, tiles_smem, n, UNIT_K // STEP, zeros)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(part_smem, out_row, reduction_op="add")


def _round_rows(rows_smem):
    """rows_smem's f32 rows rounded to bf16 in place, as the model's residual stream is, and committed (the
    norm's threads and CTA 0's TMA add of the residual read them)."""
    flat = plgpu.Layout.WG_STRIDED(tuple(rows_smem.shape), vec_size=2)
    rows_smem[...] = plgpu.load(rows_smem, layout=flat).astype(jnp.bfloat16).astype(jnp.float32)
    plgpu.commit_smem()


def token_tiles(rows: int, dtype=jnp.bfloat16) -> tuple:
    """The token's tiles as two views of the same shared memory, for a ``plgpu.RefUnion`` (each view its own
    group, both at offset 0): ``rows`` [8, 64] tiles as wgmma's B (tiled, 128-byte swizzled), and the same
    bytes as ``rows`` flat rows [rows, 8 * 64], flat row i holding tile i's 8 rows in turn. A swizzle only
    permutes a tile's 16-byte chunks by the row's index within the tile, so a tile's first row is the first 64
    columns of its flat row, in order."""
    return (plgpu.SMEM((rows * TOKEN_N, HALF), dtype, transforms=_TILING),
            plgpu.SMEM((rows, TOKEN_N * HALF), dtype))


def _strided(shape, vec_size: int = 8):
    """The warpgroup-strided layout of ``shape`` with the widest vector (at most ``vec_size``) it takes."""
    size = math.prod(shape)
    return plgpu.Layout.WG_STRIDED(tuple(shape), vec_size=next(
        v for v in (8, 4, 2, 1) if v <= vec_size and size % (128 * v) == 0 and shape[-1] % v == 0))


def _store_tiles(x, flat_smem):
    """x [n, 64] (f32, a ``_strided`` layout) as the first rows of the token's tiles 0 .. n - 1 (``token_tiles``'
    flat view), rounded to the tiles' dtype, their other rows zeros; committed. Tiles from n on are left as
    they are."""
    n = x.shape[0]
    flat_smem.at[pl.ds(0, n), pl.ds(0, HALF)][...] = x.astype(flat_smem.dtype)
    below = (n, (TOKEN_N - 1) * HALF)
    flat_smem.at[pl.ds(0, n), pl.ds(HALF, below[1])][...] = plgpu.layout_cast(
        jnp.zeros(below, flat_smem.dtype), _strided(below))
    plgpu.commit_smem()


def _build_tiles(rows_smem, flat_smem):
    """rows_smem f32[n, 64] as the token's tiles 0 .. n - 1 (``_store_tiles``)."""
    _store_tiles(plgpu.load(rows_smem, layout=_strided(rows_smem.shape, 2)), flat_smem)


def _normed(x, g, depth: int, eps: float):
    """The model's RMSNorm of the rows x (f32 holding bf16 values, one ``WG_STRIDED`` array of ``depth``
    elements) with weights g (f32, the same layout): x * 1 / rms rounded to bf16, times g (f32; the caller
    rounds it as it stores)."""
    inv_rms = lax.rsqrt(jnp.sum(x * x) / depth + eps)
    return (x * inv_rms).astype(jnp.bfloat16).astype(jnp.float32) * g


def _norm_tiles(xin_smem, g_smem, flat_smem, eps: float):
    """RMSNorm of the rows xin_smem f32[n, 64] (bf16 values) with weights g_smem f32[n, 64], as the model's
    (x * 1 / rms rounded to bf16, times g, rounded), as the token's tiles (``_store_tiles``): the rows as one
    ``WG_STRIDED`` array (elementwise work on 64-wide chunks in the reduced WGMMA layout is slow)."""
    rows = xin_smem.shape[0]
    flat = _strided((rows, HALF), 2)
    _store_tiles(_normed(plgpu.load(xin_smem, layout=flat), plgpu.load(g_smem, layout=flat), rows * HALF, eps),
                 flat_smem)


def norm_rows_out(source, weights, out_ref, eps: float, rounded_ref=None):
    """RMSNorm of the rows ``source`` f32[n, 64] in global memory (other CTAs' sums, complete since the last grid
    barrier: read by the warpgroup's own loads, as ``_load_rows`` does) with ``weights`` f32[n, 64], as the
    model's: the rows rounded to bf16 (the residual stream; also into ``rounded_ref`` when given), x * 1 / rms
    rounded to bf16, times g, into out_ref (bf16 rows [n, 64] in global memory). One CTA's work after a kernel's
    last layer: a norm (and a rounding) that would otherwise be launches after the kernel."""
    flat = _strided(tuple(source.shape), 4)
    x = plgpu.load(source, layout=flat).astype(jnp.bfloat16).astype(jnp.float32)
    if rounded_ref is not None:
        rounded_ref[...] = x.astype(rounded_ref.dtype)
    out_ref[...] = _normed(x, plgpu.load(weights, layout=flat), math.prod(source.shape), eps).astype(out_ref.dtype)


def stores_done():
    """This thread's TMA stores complete and fenced, before a release (a barrier's arrival, a signal). The fence
    is redundant by PTX (a bulk copy's completion implies a generic-async proxy fence) and costs nothing
    measurable: without it, and even without the waits, 8 layers ran as fast (round 29, ``cb1cbea``)."""
    plgpu.wait_smem_to_gmem(0)
    proxy_fence()


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def _relaxed_signal(_, sem):
    """One thread of the warpgroup adds 1 to ``sem`` (relaxed, gpu scope), after the warpgroup's barrier."""
    mgpu_utils.warpgroup_barrier()
    mgpu_utils.SemaphoreRef(mgpu_utils.memref_ptr(sem)).signal(1, relaxed=True, memory_scope="gpu")


def _arrive_and_wait(sem, num_ctas: int, count, name: str | None = None):
    """A grid barrier on the global semaphore ``sem``: this CTA's stores are out (``stores_done``), counted;
    then wait until all ``num_ctas`` have arrived ``count`` times in all, and fence the async proxy so that
    TMA loads read what the others wrote. ``name``: the barrier's, for ``PROBE_NO_WAIT`` and ``PROBE_RELAXED_AT``."""
    if unknown := [n for n in (name, *PROBE_NO_WAIT, *PROBE_RELAXED_AT) if n is not None and n not in BARRIER_NAMES]:
        raise ValueError(f"grid barrier name {', '.join(map(repr, unknown))} (the barrier's, in PROBE_NO_WAIT or "
                         f"in PROBE_RELAXED_AT); accepted: {', '.join(BARRIER_NAMES)}")
    with jax.named_scope("stores_out"):
        stores_done()
        if name in PROBE_RELAXED_AT:
            _relaxed_signal(sem)
        else:
            plgpu.semaphore_signal(sem, 1, memory_scope="gpu")
    if name in PROBE_NO_WAIT:
        return
    with jax.named_scope("barrier"):
        plgpu.semaphore_wait(sem, num_ctas * count, decrement=False, memory_scope="gpu")
        proxy_fence()


def _release(sem, c, num_ctas: int, barriers: int):
    """The kernel's end, after ``barriers`` arrivals a CTA: each arrives once more, and CTA 0, once all have
    (so every CTA has passed its last wait), takes the semaphore back to zero for the next call."""
    plgpu.semaphore_signal(sem, 1, memory_scope="gpu")

    @pl.when(c == 0)
    def _():
        plgpu.semaphore_wait(sem, num_ctas * (barriers + 1), decrement=True, memory_scope="gpu")


def _zero_rows(zero_smem, out_ref, c, num_ctas: int):
    """out_ref [L, R, 64] to zero, n rows (one TMA store from ``zero_smem`` [n, 64] of its dtype) at a time, the
    blocks dealt to the CTAs in turn (waited for by the next ``_arrive_and_wait``)."""
    zero_smem[...] = jnp.zeros(zero_smem.shape, zero_smem.dtype)
    plgpu.commit_smem()
    n = zero_smem.shape[0]
    num_layers, per_layer = out_ref.shape[0], out_ref.shape[1] // n

    def zero(j, _):
        b = c + j * num_ctas
        plgpu.copy_smem_to_gmem(zero_smem, out_ref.at[lax.div(b, per_layer), pl.ds(lax.rem(b, per_layer) * n, n)])
        return ()

    lax.fori_loop(0, pl.cdiv(num_layers * per_layer - c, num_ctas), zero, ())


def _unit_sums(ring, full, free, tiles_smem, base, boxes, zeros, first=0, transpose: bool = True):
    """A GEMV unit's products: its ``boxes`` boxes at ring positions base, base + 1, ... times the token's tiles
    (box i's halves with tiles 2 (first + i) and 2 (first + i) + 1), each half into its own accumulator, a
    box's slot freed once the next box's products are issued -> the token's 64 column sums (column 0 of the
    products; reduced WGMMA layout). A box's halves are [64 K rows, 64 columns] (``transpose``: the wgmma's A
    is the half transposed) or [64 columns, 64 K] (the A as it lands). ``boxes``: a Python int (unrolled) or
    a traced count of at least 1."""
    def box(accs, i):
        slot = lax.rem(base + i, RING)
        plgpu.barrier_wait(full.at[slot])
        for h in range(2):
            token = tiles_smem.at[pl.ds((2 * (first + i) + h) * TOKEN_N, TOKEN_N)].transpose((1, 0))
            half = ring.at[slot, h]
            plgpu.wgmma(accs[h], half.transpose((1, 0)) if transpose else half, token)

        def previous_done():  # the previous box's products are done (this box's may run on): its slot is free
            plgpu.wgmma_wait(2)
            plgpu.barrier_arrive(free.at[lax.rem(base + i - 1, RING)])
        if isinstance(i, int):
            if i:
                previous_done()
        else:
            pl.when(i > 0)(previous_done)

    def products(accs):
        if isinstance(boxes, int) and boxes == 1:
            box(accs, 0)
        else:
            lax.fori_loop(0, boxes, lambda i, _: box(accs, i), None)

    acc0, acc1 = pl.run_state(products)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
    plgpu.barrier_arrive(free.at[lax.rem(base + boxes - 1, RING)])
    return jnp.sum(acc0 + acc1, axis=1)


def _load_rows(source, rows_smem):
    """``source`` (f32 rows [..., 64] in global memory that other CTAs wrote before the last grid barrier) into
    rows_smem by the warpgroup's own loads: no mbarrier to hold. The attention phases read their inputs so.
    In the MoE half these loads measured no faster than TMA (41.2 against 40.8 µs a layer; decode_profile.md
    round 23), so it keeps TMA."""
    rows_smem[...] = plgpu.load(source, layout=_strided(source.shape, 4))
    plgpu.commit_smem()


def _input_tiles(source, rows_smem, flat_smem, bar):
    """``source`` (f32 rows [n, 64] in global memory) by TMA into rows_smem, then as the token's tiles 0 .. n - 1
    (``flat_smem``: ``token_tiles``' flat view)."""
    with jax.named_scope("input"):
        plgpu.copy_gmem_to_smem(source, rows_smem, bar)
        plgpu.barrier_wait(bar)
    with jax.named_scope("tiles"):
        _build_tiles(rows_smem, flat_smem)


def _body(x_ref, w_ref, out_ref, ring, xin_smem, tiles_union, row_smem, zero_smem, full, free, xin_bar, *,
          num_layers: int, depth: int):
    # x_ref f32[D / 64, 64]; w_ref bf16[L, D, D]; out_ref f32[L, D / 64, 64] (layer l's outputs, summed
    # by the CTAs' TMA adds); scratch: the ring [RING, 2, 64, 64], the CTA's K range of the input f32[UNIT_K
    # / 64, 64], its tiles bf16[UNIT_K / 64 * 8, 64] (``token_tiles``), a partial row f32[64], zeros f32[8, 64];
    # barriers
    tiles_smem, flat_smem = tiles_union
    c = lax.axis_index("c")
    ranges = depth // UNIT_K
    tile, kq = lax.div(c, ranges), lax.rem(c, ranges)
    boxes = UNIT_K // STEP
    num_ctas = _ctas(depth)
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
    chunks = UNIT_K // HALF

    def loads():
        """Warpgroup 1: box after box of every layer, each once its slot is free."""
        def layer_loads(layer, _):
            _unit_boxes(ring, full, free, layer * boxes, w_ref.at[layer], tile, kq)
            return ()

        lax.fori_loop(0, num_layers, layer_loads, ())

    def input_tiles(source):  # the CTA's K range of ``source`` (f32 rows [D / 64, 64])
        _input_tiles(source.at[pl.ds(kq * chunks, chunks)], xin_smem, flat_smem, xin_bar.at[0])

    def compute():
        _zero_rows(zero_smem, out_ref, c, num_ctas)  # every layer's output rows, then the first barrier
        input_tiles(x_ref)
        _arrive_and_wait(sem, num_ctas, 1)
        zeros = plgpu.layout_cast(jnp.zeros((HALF, TOKEN_N), jnp.float32), plgpu.Layout.WGMMA)

        def layer_body(layer, _):
            with jax.named_scope("products"):
                _unit_store(ring, full, free, tiles_smem, layer * boxes, zeros, row_smem, out_ref.at[layer, tile])
            _arrive_and_wait(sem, num_ctas, layer + 2)

            @pl.when(layer + 1 < num_layers)
            def _():
                input_tiles(out_ref.at[layer])
            return ()

        lax.fori_loop(0, num_layers, layer_body, ())
        _release(sem, c, num_ctas, num_layers + 1)

    pl.when(lax.axis_index("wg") == 0)(compute)
    pl.when(lax.axis_index("wg") == 1)(loads)


def gemv_chain(x, w, profile_dir: str | None = None):
    """x [D] bf16, w [L, D, D] bf16 -> x_L [D] bf16, x_{l+1} = bf16(x_l @ w[l]) with f32 sums: L dependent
    GEMVs in one persistent kernel (shapes must pass ``supports``). ``profile_dir``: a per-CTA trace."""
    num_layers, depth, width = w.shape
    if x.shape != (depth,) or width != depth:
        raise ValueError(f"gemv_chain: x {x.shape}, w {w.shape}; expected x [D] and w [L, D, D]")
    if depth % UNIT_K or _ctas(depth) > num_sms():
        raise ValueError(f"gemv_chain: depth {depth} (a multiple of {UNIT_K} whose {_ctas(depth)} CTAs fit the GPU's "
                         f"{num_sms()} SMs at once)")
    rows = depth // HALF
    kernel = functools.partial(_body, num_layers=num_layers, depth=depth)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_layers, rows, HALF), jnp.float32),
        scratch_types=[
            plgpu.SMEM((RING, 2, HALF, HALF), w.dtype, transforms=_TILING),  # the ring of boxes
            plgpu.SMEM((UNIT_K // HALF, HALF), jnp.float32),  # the CTA's K range of the input
            plgpu.RefUnion(*token_tiles(UNIT_K // HALF, w.dtype)),  # its tiles
            plgpu.SMEM((HALF,), jnp.float32),  # the CTA's partial outputs
            plgpu.SMEM((8, HALF), jnp.float32),  # zeros for the output rows
            plgpu.Barrier(num_arrivals=2, num_barriers=RING),  # a box's two halves landed
            plgpu.Barrier(num_barriers=RING),  # a slot's products are done
            plgpu.Barrier(num_barriers=1),  # the input's K range landed
        ],
        grid=(_ctas(depth),),
        grid_names=("c",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, **({"profile_space": 1024, "profile_dir": profile_dir} if profile_dir else {})),
    )(x.astype(jnp.float32).reshape(rows, HALF), w)
    return out[-1].reshape(depth).astype(x.dtype)


def gemv_chain_reference(x, w):
    """The same chain in jnp: each layer's product in f32, rounded to x's dtype."""
    def layer(x, w_l):
        return (x.astype(jnp.float32) @ w_l.astype(jnp.float32)).astype(x.dtype), None
    return lax.scan(layer, x, w)[0]
