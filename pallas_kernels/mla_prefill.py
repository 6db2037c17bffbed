"""Causal self-attention at MLA shapes (expanded form): per-head keys decompressed from the latent.

q/k head dim = qk_nope + qk_rope (128 + 64 in DeepSeek) kept as two parts, the rope key shared by all
heads; v head dim 128.

The kernel is a causal flash attention on the Triton lowering. 192 is not a power of two, so the
score is two dots, q_nope·k_nope + q_pe·k_pe, and k_pe is read once per key block for the head.
A program owns one (head, sequence, query block) and walks its key blocks in two loops: the blocks
wholly below the diagonal without masks, then the diagonal blocks with the causal mask. Blocks above
the diagonal are never read.

On Hopper (bf16/f16, T a multiple of 128) the Mosaic GPU kernel in ``mla_prefill_mgpu.py`` (TMA,
wgmma, FlashAttention-3 style) replaces this one; ``impl`` picks ("auto", "triton", "mosaic").
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import mla_prefill_mgpu
from pallas_kernels.common import dot_precision

_LOG2E = math.log2(math.e)


class PrefillBlocks(NamedTuple):
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


# By input itemsize. bf16: a 64-key stage is k (64 x 192) + v (64 x 128) = 40 KiB; with three stages
# and the 128 x 192 query tile, 168 KiB of shared memory and ~228 registers at 8 warps on sm_90 (Triton
# 3.8, wgmma). 128 x 128 at three stages would need 288 KiB. f32 halves both blocks.
PREFILL_BLOCKS = {
    2: PrefillBlocks(block_q=128, block_k=64, num_warps=8, num_stages=3),
    4: PrefillBlocks(block_q=64, block_k=32, num_warps=4, num_stages=2),
}


def _prefill_kernel(
    q_nope_ref,  # [T, Dn]: this (sequence, head)
    q_pe_ref,  # [T, R]
    k_nope_ref,  # [T, Dn]
    k_pe_ref,  # [T, R]: shared by all heads
    v_ref,  # [T, Dv]
    o_ref,  # [T, Dv]
    *,
    seq_len: int,
    block_q: int,
    block_k: int,
    scale_log2e: float,
):
    # The last query blocks have the most keys: launch them first so the tail of the grid is short.
    q_start = (pl.num_programs(2) - 1 - pl.program_id(2)) * block_q
    q_rows = pl.ds(q_start, block_q)
    row = q_start + jnp.arange(block_q)  # i32[block_q]
    row_ok = (row < seq_len)[:, None]
    q_nope = plgpu.load(q_nope_ref.at[q_rows, :], mask=row_ok, other=0)
    q_pe = plgpu.load(q_pe_ref.at[q_rows, :], mask=row_ok, other=0)

    def body(j, carry, *, diagonal: bool):
        m, l, acc = carry  # f32[block_q] (log2 units), f32[block_q], f32[block_q, Dv]
        k_rows = pl.ds(j * block_k, block_k)
        col = j * block_k + jnp.arange(block_k)  # i32[block_k]
        if diagonal:  # the last block may run past T
            col_ok = (col < seq_len)[:, None]
            k_nope = plgpu.load(k_nope_ref.at[k_rows, :], mask=col_ok, other=0)
            k_pe = plgpu.load(k_pe_ref.at[k_rows, :], mask=col_ok, other=0)
            v = plgpu.load(v_ref.at[k_rows, :], mask=col_ok, other=0)
        else:  # plgpu.load, not ref[...]: interpret mode pads a block longer than T
            k_nope, k_pe, v = (plgpu.load(r.at[k_rows, :]) for r in (k_nope_ref, k_pe_ref, v_ref))
        precision = dot_precision(k_nope.dtype)
        s = (jax.lax.dot_general(q_nope, k_nope, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32, precision=precision)
             + jax.lax.dot_general(q_pe, k_pe, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32, precision=precision)) * scale_log2e
        if diagonal:
            # Every row has seen key 0 before or within its first diagonal block, so m is finite.
            s = jnp.where(col[None, :] <= row[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        correction = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * correction + p.sum(axis=1)
        acc = acc * correction[:, None] + jnp.dot(p.astype(v.dtype), v,
                                                  preferred_element_type=jnp.float32, precision=precision)
        return m_new, l, acc

    value_dim = o_ref.shape[-1]
    carry = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
             jnp.zeros((block_q, value_dim), jnp.float32))
    num_below = q_start // block_k  # key blocks that end at or before this query block starts
    carry = jax.lax.fori_loop(0, num_below, functools.partial(body, diagonal=False), carry)
    num_blocks = pl.cdiv(jnp.minimum(q_start + block_q, seq_len), block_k)
    _, l, acc = jax.lax.fori_loop(num_below, num_blocks, functools.partial(body, diagonal=True),
                                  carry)
    plgpu.store(o_ref.at[q_rows, :], (acc / l[:, None]).astype(o_ref.dtype), mask=row_ok)


# "auto": the Mosaic GPU kernel where it runs (Hopper, bf16/f16, T a multiple of 128, head dims multiples
# of 64; mla_prefill_mgpu.supports), else the Triton one. "triton" / "mosaic" force one.
IMPLS = ("auto", "triton", "mosaic")


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "num_warps",
                                             "num_stages", "interpret", "impl"))
def mla_prefill(q_nope, q_pe, k_nope, k_pe, v, scale, *, block_q=None, block_k=None, num_warps=None,
                num_stages=None, interpret=False, impl="auto"):
    """The semantics of ``mla_prefill_reference``: q_nope [B, T, H, Dn], q_pe [B, T, H, R],
    k_nope [B, T, H, Dn], k_pe [B, T, R], v [B, T, H, Dv] -> [B, T, H, Dv] in v.dtype, causal.

    ``scale`` is a Python float. Any T works (the tail block is masked); Dn, R, Dv and the blocks
    must be powers of two on the GPU. Unset tuning arguments come from ``PREFILL_BLOCKS``, with the
    blocks shrunk to T for short sequences.
    """
    batch, seq_len, num_heads, nope_dim = q_nope.shape
    rope_dim, value_dim = q_pe.shape[-1], v.shape[-1]
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not supported; accepted: {', '.join(IMPLS)}")
    why_not = "interpret mode" if interpret and impl != "mosaic" else \
        mla_prefill_mgpu.supports(seq_len, nope_dim, rope_dim, value_dim, v.dtype, interpret=interpret)
    if impl == "mosaic" and why_not:
        raise ValueError(f"impl='mosaic' cannot run here: {why_not}")
    if impl == "mosaic" or (impl == "auto" and not why_not and not (block_q or block_k)):
        return mla_prefill_mgpu.mla_prefill_mgpu(q_nope, q_pe, k_nope, k_pe, v, scale, interpret=interpret)
    blocks = PREFILL_BLOCKS[min(jnp.dtype(q_nope.dtype).itemsize, 4)]
    short = max(16, pl.next_power_of_2(seq_len))  # 16: the smallest tensor-core tile
    block_q = block_q or min(blocks.block_q, short)
    block_k = block_k or min(blocks.block_k, short)
    if not interpret:
        for name, value in (("qk_nope_head_dim", nope_dim), ("qk_rope_head_dim", rope_dim),
                            ("v_head_dim", value_dim), ("block_q", block_q), ("block_k", block_k)):
            if value & (value - 1):
                raise ValueError(f"mla_prefill on the Triton lowering needs {name} to be a power "
                                 f"of two, got {value}")
    kernel = functools.partial(_prefill_kernel, seq_len=seq_len, block_q=block_q, block_k=block_k,
                               scale_log2e=scale * _LOG2E)
    per_head = lambda dim: pl.BlockSpec((None, seq_len, None, dim), lambda h, b, i: (b, 0, h, 0))
    return pl.pallas_call(
        kernel,
        grid=(num_heads, batch, pl.cdiv(seq_len, block_q)),
        in_specs=[per_head(nope_dim), per_head(rope_dim), per_head(nope_dim),
                  pl.BlockSpec((None, seq_len, rope_dim), lambda h, b, i: (b, 0, 0)),
                  per_head(value_dim)],
        out_specs=per_head(value_dim),
        out_shape=jax.ShapeDtypeStruct((batch, seq_len, num_heads, value_dim), v.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or blocks.num_warps,
                                             num_stages=num_stages or blocks.num_stages),
        interpret=interpret,
        name=f"mla_prefill_q{block_q}_k{block_k}",
    )(q_nope, q_pe, k_nope, k_pe, v)


def mla_prefill_reference(q_nope, q_pe, k_nope, k_pe, v, scale):
    """q_nope [B, T, H, Dn], q_pe [B, T, H, R], k_nope [B, T, H, Dn], k_pe [B, T, R], v [B, T, H, Dv]
    -> [B, T, H, Dv] in v.dtype; causal within each sequence, softmax in f32."""
    s = (jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope, preferred_element_type=jnp.float32)
         + jnp.einsum("bqhr,bkr->bhqk", q_pe, k_pe, preferred_element_type=jnp.float32)) * scale
    seq_len = q_nope.shape[1]
    causal = jnp.tril(jnp.ones((seq_len, seq_len), bool))
    s = jnp.where(causal, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=jnp.float32).astype(v.dtype)
