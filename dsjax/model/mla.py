"""Multi-head latent attention (DeepSeek-V2/V3).

Keys and values are compressed into one latent per token, c_kv [kv_lora_rank], plus a rope key
k_pe [qk_rope_head_dim] shared by all heads. Two equal paths:
  expanded  decompress per-head k_nope = c_kv W_UK and v = c_kv W_UV, then ordinary attention (prefill);
  absorbed  fold W_UK into the query and W_UV into the output and attend over the latent itself (decode),
            so the cache holds only c_kv and k_pe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.model import dispatch
from dsjax.model.norms import RMSNorm
from dsjax.model.paged import PagedBatch, PagedKVCache
from dsjax.model.params import param
from dsjax.model.rope import apply_rope, rope_frequencies
from pallas_kernels.kv_quant import quantize_latent


class MLAttention(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        d, h = config.hidden_size, config.num_attention_heads
        c, r = config.kv_lora_rank, config.qk_rope_head_dim
        self.num_heads, self.nope_dim, self.rope_dim, self.latent_dim = h, config.qk_nope_head_dim, r, c
        if config.q_lora_rank is None:
            self.q_proj = param(rngs, (d, h, config.qk_head_dim), ("embed", "heads", "qk_head"), dtype)
            self.q_a = self.q_a_norm = self.q_b = None
        else:
            q = config.q_lora_rank
            self.q_proj = None
            self.q_a = param(rngs, (d, q), ("embed", "q_lora"), dtype)
            self.q_a_norm = RMSNorm(q, config.rms_norm_eps, "q_lora", dtype)
            self.q_b = param(rngs, (q, h, config.qk_head_dim), ("q_lora", "heads", "qk_head"), dtype)
        self.kv_a = param(rngs, (d, c + r), ("embed", "kv_lora"), dtype)
        self.kv_a_norm = RMSNorm(c, config.rms_norm_eps, "kv_lora", dtype)
        self.w_uk = param(rngs, (c, h, config.qk_nope_head_dim), ("kv_lora", "heads", "qk_head"), dtype)
        self.w_uv = param(rngs, (c, h, config.v_head_dim), ("kv_lora", "heads", "v_head"), dtype)
        self.o_proj = param(rngs, (h, config.v_head_dim, d), ("heads", "v_head", "embed"), dtype)
        inv_freq, self.cos_sin_scale = rope_frequencies(config)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: a constant of the graph
        self.interleave = config.rope_interleave
        self.scale = config.softmax_scale

    def _rope(self, x, positions):
        return apply_rope(x, positions, jnp.asarray(self.inv_freq, jnp.float32), self.cos_sin_scale,
                          self.interleave)

    def stacked_projections(self, index) -> dict:
        """Inside a layer scan over stacked layers: every layer's projection weights (each [L, K, ...]),
        the kv_a and q LoRA norms' weights [L, C] / [L, Q] and this layer's index, for the decode kernels that read one
        layer's slice in place."""
        names = ("q_proj", "q_a", "q_b", "kv_a", "w_uk", "w_uv", "o_proj")
        stacked = {"index": index, **{n: getattr(self, n)[...] for n in names if getattr(self, n) is not None},
                   "kv_a_norm": self.kv_a_norm.weight[...]}
        if self.q_a_norm is not None:
            stacked["q_a_norm"] = self.q_a_norm.weight[...]
        return stacked

    @staticmethod
    def _stacked_fits(token_shape, stacked) -> bool:
        """A step of few tokens (``token_shape``: the leading [T] of an operand) with the layer stack at
        hand: the stacked decode kernels' case."""
        return stacked is not None and len(token_shape) == 1 and token_shape[0] <= dispatch.STACKED_GEMV_MAX_TOKENS

    def queries(self, x, positions):
        """x [..., D] -> q_nope [..., H, Dn], q_pe [..., H, R] (rotated)."""
        if self.q_proj is not None:
            q = jnp.einsum("...d,dhk->...hk", x, self.q_proj[...])
        else:
            q = jnp.einsum("...q,qhk->...hk", self.q_a_norm(x @ self.q_a[...]), self.q_b[...])
        return self._split_queries(q, positions)

    def latents(self, x, positions):
        """x [..., D] -> c_kv [..., C] (normed latent), k_pe [..., R] (rotated): what the cache stores."""
        return self._split_latents(x @ self.kv_a[...], positions)

    def _split_queries(self, q, positions):
        return q[..., :self.nope_dim], self._rope(q[..., self.nope_dim:], positions)

    def _split_latents(self, kv, positions):
        return self.kv_a_norm(kv[..., :self.latent_dim]), self._rope(kv[..., self.latent_dim:], positions)

    def _decode_projections(self, x, positions, stacked, norm, backend):
        """The queries (q_nope, q_pe) and kv_a's output f32[T, C + R] of a few raw tokens x [T, D] from the
        layer stack: the attention's RMSNorm (``norm``'s eps, the stack's weights ``stacked["norm"]``) and
        the q (or q_a) and kv_a products in one stacked-GEMV launch; with a q LoRA, q_b in a second with
        q_a_norm fused in."""
        index, heads = stacked["index"], stacked["q_proj" if self.q_proj is not None else "q_b"]  # [L, K, H, Dqk]
        q, kv, _ = self._first_launch(x, stacked, norm, backend)
        if self.q_proj is None:
            q, _ = dispatch.stacked_matmuls(q.astype(x.dtype), (_flat_heads(heads),), index, backend,
                                            norm=(stacked["q_a_norm"], self.q_a_norm.eps))
        q = q.astype(x.dtype).reshape(x.shape[0], *heads.shape[-2:])  # this rank's heads (tensor ranks hold some)
        return self._split_queries(q, positions), kv

    def _first_launch(self, x, stacked, norm, backend, partials: bool = False):
        """The attention's RMSNorm with the q (or q_a) and kv_a products of raw tokens x [T, D]: one
        stacked-GEMV launch -> (q, kv, normed rows), or with ``partials`` the unsummed split-K partials
        and the rows' partial sums of squares (``dispatch.stacked_matmuls``)."""
        q_weight = _flat_heads(stacked["q_proj"]) if self.q_proj is not None else stacked["q_a"]
        return dispatch.stacked_matmuls(x, (q_weight, stacked["kv_a"]), stacked["index"], backend,
                                        norm=(stacked["norm"], norm.eps), partials=partials)

    @classmethod
    def _folds_queries(cls, token_shape, stacked) -> bool:
        """A step of at most ``dispatch.QUERY_FOLD_MAX_TOKENS`` tokens on the stacked kernels: W_UK goes into
        write_latents (no per-head GEMV launch of its own)."""
        return cls._stacked_fits(token_shape, stacked) and token_shape[0] <= dispatch.QUERY_FOLD_MAX_TOKENS

    def _decode_write(self, x, cache: PagedKVCache, layer, batch: PagedBatch, stacked, norm, backend):
        """``_decode_projections`` and the cache write of a few raw tokens x [T, D] into one unquantized
        pool -> (q_latent, q_pe, cache): kv_a_norm, rope and both writes in one launch (write_latents).
        Without a q LoRA that launch also takes the first launch's split-K partials as they are (the
        attention's RMSNorm scale, the q epilogue and the q rope with them: four XLA fusions fewer) and
        absorbs the nope queries through W_UK (no launch of their own; up to
        ``dispatch.QUERY_FOLD_MAX_TOKENS`` tokens)."""
        write = lambda kv, **more: dispatch.write_latents(
            cache.c_kv, cache.k_pe, kv, batch.slot_mapping, batch.positions, layer, stacked["kv_a_norm"],
            stacked["index"], backend, eps=self.kv_a_norm.eps, inv_freq=self.inv_freq,
            cos_sin_scale=self.cos_sin_scale, interleave=self.interleave, **more)
        if self.q_proj is None:
            (q_nope, q_pe), kv = self._decode_projections(x, batch.positions, stacked, norm, backend)
            c_kv, k_pe = write(kv)
            q_latent = self.absorb_query(q_nope, stacked, backend)
        else:
            q, kv, squares = self._first_launch(x, stacked, norm, backend, partials=True)
            num_heads = stacked["q_proj"].shape[2]  # [L, D, H, Dqk]: this rank's heads
            fold = self._folds_queries(x.shape[:-1], stacked)
            c_kv, k_pe, queries, q_pe = write(kv, squares=squares, row_rms=(x.shape[-1], norm.eps), q=q,
                                              q_heads=(num_heads, self.nope_dim), w_uk=stacked["w_uk"] if fold else None)
            q_latent = queries if fold else self.absorb_query(queries, stacked, backend)  # absorbed, or q_nope
        return q_latent, q_pe, cache._replace(c_kv=c_kv, k_pe=k_pe)

    def absorb_query(self, q_nope, stacked=None, backend="reference"):
        """q_nope [..., H, Dn] -> [..., H, C]: each head's query in the latent space (W_UK folded in)."""
        if self._stacked_fits(q_nope.shape[:-2], stacked):
            return dispatch.stacked_head_matmul(q_nope, stacked["w_uk"], stacked["index"], backend, contract_rows=False,
                                                out_dtype=q_nope.dtype)
        return jnp.einsum("...hn,chn->...hc", q_nope, self.w_uk[...])

    def output(self, latent_ctx, stacked=None, backend="reference"):
        """latent_ctx [..., H, C] -> [..., D]: W_UV, then o_proj over every head (a few tokens with the
        layer stack at hand: both through the stacked decode kernels, the layer's weights read in place)."""
        if self._stacked_fits(latent_ctx.shape[:-2], stacked):
            index = stacked["index"]
            v_ctx = dispatch.stacked_head_matmul(latent_ctx, stacked["w_uv"], index, backend, contract_rows=True)
            o_proj = stacked["o_proj"]  # [L, H, V, D]: H * V is one K axis
            out, = dispatch.stacked_matmuls(v_ctx.astype(latent_ctx.dtype).reshape(latent_ctx.shape[0], -1),
                                            (o_proj.reshape(o_proj.shape[0], -1, o_proj.shape[-1]),), index, backend)
            return out.astype(latent_ctx.dtype)
        v_ctx = jnp.einsum("...hc,chv->...hv", latent_ctx, self.w_uv[...])
        flat = v_ctx.reshape(*v_ctx.shape[:-2], -1)  # [..., H * V] against o_proj [H, V, D]: one K axis
        return jnp.einsum("...k,kd->...d", flat, self.o_proj[...].reshape(flat.shape[-1], -1))

    def __call__(self, x, positions, *, mode: str, backend: str):
        """Full causal attention without a cache: x [B, T, D], positions i32[B, T] -> [B, T, D], a
        partial sum over tensor ranks (each holds some heads)."""
        q_nope, q_pe = self.queries(x, positions)
        c_kv, k_pe = self.latents(x, positions)
        if mode == "expanded":
            k_nope = jnp.einsum("btc,chn->bthn", c_kv, self.w_uk[...])
            v = jnp.einsum("btc,chv->bthv", c_kv, self.w_uv[...])
            ctx = dispatch.mla_prefill(q_nope, q_pe, k_nope, k_pe, v, self.scale, backend)
            return jnp.einsum("bthv,hvd->btd", ctx, self.o_proj[...])
        if mode != "absorbed":
            raise ValueError(f"attention mode={mode!r} is not supported; accepted: expanded, absorbed")
        # Absorbed over the fresh latents: each sequence is one cache block of size T.
        batch, seq_len, num_heads = q_nope.shape[:3]  # this rank's heads under tensor parallelism
        seq_ids = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), seq_len)
        tables = jnp.arange(batch, dtype=jnp.int32)[:, None]
        ctx = dispatch.mla_paged_attention(
            self.absorb_query(q_nope).reshape(batch * seq_len, num_heads, -1),
            q_pe.reshape(batch * seq_len, num_heads, -1), c_kv, k_pe, tables, seq_ids,
            positions.reshape(-1), self.scale, backend)
        return self.output(ctx.reshape(batch, seq_len, num_heads, -1))

    @staticmethod
    def _write(cache: PagedKVCache, layer, batch: PagedBatch, c_kv, k_pe) -> PagedKVCache:
        """The step's latents c_kv [T, C] and k_pe [T, R] into the cache at their slots (padding: dropped)."""
        block_size = cache.c_kv.shape[2]
        blocks, offsets = batch.slot_mapping // block_size, batch.slot_mapping % block_size
        write = lambda pool, rows: pool.at[layer, blocks, offsets].set(rows.astype(pool.dtype), mode="drop")
        c_kv_scale = cache.c_kv_scale
        if c_kv_scale is not None:  # 8-bit cache: quantized as written, per token (and group); with two
            # pools new tokens always land in the full-precision one
            c_kv, scale = quantize_latent(c_kv, cache.quantization, c_kv_scale.shape[-1])
            c_kv_scale = write(c_kv_scale, scale)
        cache = cache._replace(c_kv=write(cache.c_kv, c_kv), k_pe=write(cache.k_pe, k_pe), c_kv_scale=c_kv_scale)
        if jax.default_backend() == "cpu":
            # The attention and the layer scan's carry read one written pool: without the barrier XLA
            # CPU fuses a one-token write into each reader separately and copies the whole pool for
            # each (decode cost grew with the pool). XLA GPU writes in place already; it is left as is.
            cache = jax.lax.optimization_barrier(cache)
        return cache

    def paged(self, x, cache: PagedKVCache, layer, batch: PagedBatch, *, norm: RMSNorm, backend: str,
              stacked=None):
        """Packed tokens x [T, D] of one engine step, before the attention's RMSNorm ``norm``: write their
        latents into ``cache`` at layer ``layer``, then attend (absorbed) over each token's sequence. ->
        ([T, D] partial over tensor ranks, updated cache). ``stacked``: ``stacked_projections`` of the
        layer scan plus every layer's ``norm`` weights under "norm", or None."""
        stacked_step = self._stacked_fits(x.shape[:-1], stacked)
        if stacked_step and cache.c_kv_scale is None and cache.pools is None:
            q_latent, q_pe, cache = self._decode_write(x, cache, layer, batch, stacked, norm, backend)
        else:
            if stacked_step:
                (q_nope, q_pe), kv = self._decode_projections(x, batch.positions, stacked, norm, backend)
                cache = self._write(cache, layer, batch, *self._split_latents(kv.astype(x.dtype), batch.positions))
            else:
                x = norm(x)
                q_nope, q_pe = self.queries(x, batch.positions)
                cache = self._write(cache, layer, batch, *self.latents(x, batch.positions))
            q_latent = self.absorb_query(q_nope, stacked, backend)
        num_blocks, block_size = cache.c_kv.shape[1:3]
        # Flattening [L, N] is free; the kernel shifts the block ids to this layer's (no copy).
        flat = lambda a: None if a is None else a.reshape(-1, block_size, a.shape[-1])
        if cache.pools:  # two pools: the kernel finds the layer and each block's pool itself
            ctx = dispatch.mla_paged_attention(
                q_latent, q_pe, flat(cache.c_kv), flat(cache.k_pe), batch.block_tables,
                batch.seq_ids, batch.positions, self.scale, backend, pools=cache.pools,
                compressed=(flat(cache.c_kv_compressed), flat(cache.compressed_scale), layer))
        else:
            ctx = dispatch.mla_paged_attention(
                q_latent, q_pe, flat(cache.c_kv), flat(cache.k_pe), batch.block_tables, batch.seq_ids,
                batch.positions, self.scale, backend, c_kv_scale=flat(cache.c_kv_scale), layer=layer,
                layer_pages=num_blocks)
        return self.output(ctx, stacked, backend), cache


def _flat_heads(w):
    """A stacked per-head weight [L, K, H, Dh] as the stacked GEMVs take it: [L, K, H * Dh] (free)."""
    return w.reshape(w.shape[0], w.shape[1], -1)
