"""The DeepSeek-V2/V3 decoder: embeddings, first_k_dense_replace dense layers, MoE layers, norm, lm_head.

Layers of one kind are stacked along a leading 'layers' axis and run with ``lax.scan``, so compile time
does not grow with depth (V3 has 61 layers).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.model.dispatch import resolve_backend
from dsjax.model.mla import MLAttention
from dsjax.model.moe import MLP, MoE
from dsjax.model.norms import RMSNorm
from dsjax.model.paged import PagedBatch, PagedKVCache
from dsjax.model.params import INIT_STD, param


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, moe: bool, dtype, rngs: nnx.Rngs):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.attn_norm = RMSNorm(d, eps, "embed", dtype)
        self.attn = MLAttention(config, dtype, rngs)
        self.mlp_norm = RMSNorm(d, eps, "embed", dtype)
        self.mlp = MoE(config, dtype, rngs) if moe else MLP(d, config.intermediate_size, dtype, rngs)

    def _mlp(self, x, backend, stacked_experts):
        if isinstance(self.mlp, MoE):
            return self.mlp(x, backend=backend, stacked_experts=stacked_experts)
        return self.mlp(x, backend=backend)

    def __call__(self, x, positions, *, mode: str, backend: str, stacked_experts=None):
        """x [B, T, D] -> [B, T, D]."""
        h = x + self.attn(self.attn_norm(x), positions, mode=mode, backend=backend)
        flat = h.reshape(-1, h.shape[-1])
        return h + self._mlp(self.mlp_norm(flat), backend, stacked_experts).reshape(h.shape)

    def paged(self, x, cache: PagedKVCache, layer, batch: PagedBatch, *, backend: str, stacked_experts=None):
        """x [T, D] -> ([T, D], cache)."""
        attn_out, cache = self.attn.paged(self.attn_norm(x), cache, layer, batch, backend=backend)
        h = x + attn_out
        return h + self._mlp(self.mlp_norm(h), backend, stacked_experts), cache


def _stacked_layers(num_layers: int, config: ModelConfig, moe: bool, dtype, rngs: nnx.Rngs):
    if num_layers == 0:
        return None

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
        return DecoderLayer(config, moe, dtype, rngs)

    return create(rngs)


def _scan_layers(stack, carry, first_layer: int, step):
    """carry = step(layer_module, carry, global_layer_index, index_in_stack) for each layer of
    ``stack`` in order."""
    if stack is None:
        return carry
    graphdef, state = nnx.split(stack)
    num_layers = jax.tree.leaves(state)[0].shape[0]

    def body(carry, xs):
        layer_state, index = xs
        return step(nnx.merge(graphdef, layer_state), carry, first_layer + index, index), None

    carry, _ = jax.lax.scan(body, carry, (state, jnp.arange(num_layers, dtype=jnp.int32)))
    return carry


class DeepseekForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype="float32", kernel_backend: str = "auto",
                 rngs: nnx.Rngs):
        dtype = jnp.dtype(dtype)
        d, v = config.hidden_size, config.vocab_size
        self.config = config
        self.dtype = dtype
        self.kernel_backend = resolve_backend(kernel_backend)
        self.embed = param(rngs, (v, d), ("vocab", "embed"), dtype)
        self.dense_layers = _stacked_layers(config.num_dense_layers, config, False, dtype, rngs)
        self.moe_layers = _stacked_layers(config.num_moe_layers, config, True, dtype, rngs)
        self.norm = RMSNorm(d, config.rms_norm_eps, "embed", dtype)
        self.lm_head = None if config.tie_word_embeddings else param(rngs, (d, v), ("embed", "vocab"), dtype)

    # ----- traced (call inside jit) ------------------------------------------------------------
    def __call__(self, tokens, *, mode: str = "expanded"):
        """Full causal forward, no cache: tokens i32[B, T] -> logits f32[B, T, vocab]."""
        backend = self.kernel_backend
        x = jnp.take(self.embed[...], tokens, axis=0)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        step = lambda layer, x, _, index: layer(x, positions, mode=mode, backend=backend,
                                                stacked_experts=self._stacked_experts(index))
        x = _scan_layers(self.dense_layers, x, 0, step)
        x = _scan_layers(self.moe_layers, x, self.config.num_dense_layers, step)
        return self.compute_logits(self.norm(x))

    def _stacked_experts(self, index):
        """Every MoE layer's expert weights plus this layer's index, for kernels that read the
        stack in place (a slice taken inside the layer scan would be copied for them)."""
        if self.moe_layers is None or self.kernel_backend == "reference":
            return None
        mlp = self.moe_layers.mlp
        return mlp.w_gate[...], mlp.w_up[...], mlp.w_down[...], index

    def forward_paged(self, tokens, cache: PagedKVCache, batch: PagedBatch):
        """One engine step over packed tokens i32[T]: writes their latents into the paged cache and
        returns (final-normed hidden states [T, D], updated cache)."""
        backend = self.kernel_backend

        def step(layer, carry, index, index_in_stack):
            x, cache = carry
            return layer.paged(x, cache, index, batch, backend=backend,
                               stacked_experts=self._stacked_experts(index_in_stack))

        x = jnp.take(self.embed[...], tokens, axis=0)
        carry = _scan_layers(self.dense_layers, (x, cache), 0, step)
        x, cache = _scan_layers(self.moe_layers, carry, self.config.num_dense_layers, step)
        return self.norm(x), cache

    def compute_logits(self, hidden):
        """hidden [..., D] (final-normed) -> f32[..., vocab]."""
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.dot(hidden, head, preferred_element_type=jnp.float32)

    # ----- host ----------------------------------------------------------------------------------
    def logits(self, token_ids, *, mode: str = "expanded"):
        """int32 [B, T] -> float32 [B, T, vocab]; full causal forward without a cache."""
        tokens = jnp.asarray(token_ids, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"token_ids must be 2-D [batch, length], got shape {tokens.shape}")
        graphdef, state = nnx.split(self)
        return _logits_jit(graphdef, state, tokens, mode)


@partial(jax.jit, static_argnums=(0, 3))
def _logits_jit(graphdef, state, tokens, mode):
    return nnx.merge(graphdef, state)(tokens, mode=mode)


def abstract_model(config: ModelConfig, *, dtype="float32", kernel_backend: str = "auto"):
    """The model's structure with ShapeDtypeStruct leaves: nothing allocated."""
    return nnx.eval_shape(lambda: DeepseekForCausalLM(config, dtype=dtype, kernel_backend=kernel_backend,
                                                      rngs=nnx.Rngs(0)))


_STREAM_CHUNK = 1 << 24  # numbers per random draw: one compile, then device-speed generation


@partial(jax.jit, static_argnums=1)
def _normal_chunk(key, size):
    return jax.random.normal(key, (size,), jnp.float32)


def random_model(config: ModelConfig, *, dtype="float32", kernel_backend: str = "auto", seed: int = 0):
    """Deterministic random weights: normal(0, 0.02) like transformers' init, norms 1, router bias 0.

    All weights are cut in order from one stream of normals drawn in fixed-size chunks, so a single
    small program is compiled whatever the model's size.
    """
    graphdef, state = nnx.split(abstract_model(config, dtype=dtype, kernel_backend=kernel_backend))
    leaves, treedef = jax.tree.flatten_with_path(state)
    total = sum(leaf.size for _, leaf in leaves)
    chunk = min(_STREAM_CHUNK, 1 << max(total - 1, 1).bit_length())
    key = jax.random.key(seed)
    stream, buffer, offset, drawn = [], None, 0, 0

    def take(n):
        nonlocal buffer, offset, drawn
        pieces = []
        while n:
            if buffer is None or offset == chunk:
                buffer, offset, drawn = _normal_chunk(jax.random.fold_in(key, drawn), chunk), 0, drawn + 1
            k = min(n, chunk - offset)
            pieces.append(buffer[offset:offset + k])
            offset, n = offset + k, n - k
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)

    for path, leaf in leaves:
        name = str(path[-2].key) if len(path) >= 2 else ""
        if name == "score_bias":
            value = jnp.zeros(leaf.shape, leaf.dtype)
        elif name == "weight":  # RMSNorm scales
            value = jnp.ones(leaf.shape, leaf.dtype)
        else:
            value = (INIT_STD * take(leaf.size)).reshape(leaf.shape).astype(leaf.dtype)
        stream.append(value)
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, stream))
