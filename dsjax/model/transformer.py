"""The DeepSeek-V2/V3 decoder: embeddings, first_k_dense_replace dense layers, MoE layers, norm, lm_head.

Layers of one kind are stacked along a leading 'layers' axis and run with ``lax.scan``, so compile time
does not grow with depth (V3 has 61 layers).

With a mesh the traced methods run per device inside a shard_map (the runner's, or ``logits``'s) on
this device's shards of every weight; the few collectives they need (dsjax.parallel.collectives) are
no-ops without one.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dsjax.config import ModelConfig
from dsjax.model import dispatch
from dsjax.model.dispatch import resolve_backend
from dsjax.model.mla import MLAttention
from dsjax.model.moe import MLP, MoE
from dsjax.model.norms import RMSNorm
from dsjax.model.paged import PagedBatch, PagedKVCache
from dsjax.model.params import INIT_STD, logical_axes, param
from dsjax.parallel.collectives import embed_lookup, gather_vocab, is_manual, psum_tensor
from dsjax.parallel.expert import ExpertDispatch
from dsjax.parallel.mesh import TENSOR, num_batch_shards
from dsjax.parallel.sharding import batch_spec, checks_vma, logical_to_spec, param_shardings, param_specs
from pallas_kernels import decode_step_attention, decode_step_moe
from pallas_kernels.decode_step_attention import permute_rope_columns


class StepKernelCache(nnx.Variable):
    """Weights in the form the batch-1 step kernel takes them, derived from the model's parameters by
    ``DeepseekForCausalLM.prepare_step_kernel`` (not parameters: checkpoints and exports leave them out)."""


class LayerStack(NamedTuple):
    """Inside the layer scan: every layer's weights of the stack being scanned plus this layer's index,
    for the kernels that read one layer's slice in place (a slice taken inside the scan would be copied
    for them)."""
    index: jax.Array
    attn: dict  # MLAttention.stacked_projections, plus the attention's RMSNorm weights [L, D] as "norm"
    mlp: tuple | None  # (w_gate, w_up, w_down) of the dense MLP or the shared experts [L, ...]
    experts: tuple | None  # the routed experts' (w_gate, w_up, w_down) [L, E, ...]
    mlp_norm: jax.Array  # the MLP's RMSNorm weights [L, D]
    router: jax.Array | None  # [L, D, E], f32


class DecoderLayer(nnx.Module):
    """Attention and MLP sublayers return partial sums over the tensor ranks (each holds some heads or
    columns): each is reduced once, here, before its residual add."""

    def __init__(self, config: ModelConfig, moe: bool, dtype, rngs: nnx.Rngs, expert_dispatch: ExpertDispatch):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.attn_norm = RMSNorm(d, eps, "embed", dtype)
        self.attn = MLAttention(config, dtype, rngs)
        self.mlp_norm = RMSNorm(d, eps, "embed", dtype)
        self.mlp = MoE(config, dtype, rngs, expert_dispatch) if moe else MLP(d, config.intermediate_size, dtype, rngs)

    def _mlp(self, x, backend, stack: LayerStack | None):
        with_index = lambda ws: None if stack is None or ws is None else (*ws, stack.index)
        mlp = with_index(stack and stack.mlp)
        if isinstance(self.mlp, MoE):
            return self.mlp(x, backend=backend, stacked_experts=with_index(stack and stack.experts), stacked_shared=mlp)
        return self.mlp(x, backend=backend, stacked=mlp)

    def __call__(self, x, positions, *, mode: str, backend: str, stacked=None):
        """x [B, T, D] -> [B, T, D]."""
        h = x + psum_tensor(self.attn(self.attn_norm(x), positions, mode=mode, backend=backend))
        flat = h.reshape(-1, h.shape[-1])
        return h + psum_tensor(self._mlp(self.mlp_norm(flat), backend, stacked)).reshape(h.shape)

    def paged(self, x, cache: PagedKVCache, layer, batch: PagedBatch, *, backend: str, stacked: LayerStack = None):
        """x [T, D] -> ([T, D], cache). Steps of few tokens with the layer stack at hand fuse each
        sublayer's RMSNorm into its first stacked-GEMV launch (``MLAttention.paged``, ``MoE.decode``)."""
        attn_out, cache = self.attn.paged(x, cache, layer, batch, norm=self.attn_norm, backend=backend,
                                          stacked=stacked and stacked.attn)
        return self.mlp_paged(x + psum_tensor(attn_out), backend=backend, stacked=stacked), cache

    def mlp_paged(self, h, *, backend: str, stacked: LayerStack = None):
        """The MLP sublayer of ``paged``: h [T, D] (after the attention's residual) -> h + MLP(norm(h))."""
        if stacked is not None and h.shape[0] <= dispatch.STACKED_GEMV_MAX_TOKENS:
            if is_manual(TENSOR):  # the ranks' partial outputs are summed before the residual joins them
                return h + psum_tensor(self.mlp.decode(h, stacked, self.mlp_norm.eps, backend))
            return self.mlp.decode(h, stacked, self.mlp_norm.eps, backend, add_residual=True)
        return h + psum_tensor(self._mlp(self.mlp_norm(h), backend, stacked))


def _stacked_layers(num_layers: int, config: ModelConfig, moe: bool, dtype, rngs: nnx.Rngs,
                    expert_dispatch: ExpertDispatch):
    if num_layers == 0:
        return None

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
        return DecoderLayer(config, moe, dtype, rngs, expert_dispatch)

    return create(rngs)


def _scan_layers(stack, carry, first_layer: int, step):
    """carry = step(layer_module, carry, first_layer + index_in_stack, index_in_stack) for each layer
    of ``stack`` in order. The index rides in the scan's carry (index + 1 a step) rather than being
    sliced from an arange, and the MoE stack sits first in the paged cache's layer axis (its cache
    layer is its index in the stack, no offset to add): the scan's scalar bookkeeping is one launch a
    layer. H200, V2-Lite batch-1 compiled step (decode_profile.md round 14): 2.279 ms against 2.307
    with neither (the carry alone 2.299, the MoE stack first alone 2.316; the alternatives in git
    a8ab246). Unrolled, the scan was slower (session 23, XLA's full unroll: 2.49 ms against 2.41)."""
    if stack is None:
        return carry
    graphdef, state = nnx.split(stack)
    cache_layer = lambda index: index if first_layer == 0 else first_layer + index

    def body(carry_index, layer_state):
        carry, index = carry_index
        return (step(nnx.merge(graphdef, layer_state), carry, cache_layer(index), index), index + 1), None

    (carry, _), _ = jax.lax.scan(body, (carry, jnp.int32(0)), state)
    return carry


class DeepseekForCausalLM(nnx.Module):
    """``mesh`` (axes data, expert, tensor; dsjax.parallel.make_mesh) says where the weights live and
    how ``logits`` and the engine split the work; None: one device."""

    def __init__(self, config: ModelConfig, *, dtype="float32", kernel_backend: str = "auto",
                 mesh: Mesh | None = None, expert_dispatch: ExpertDispatch = ExpertDispatch(), rngs: nnx.Rngs):
        dtype = jnp.dtype(dtype)
        d, v = config.hidden_size, config.vocab_size
        self.config = config
        self.dtype = dtype
        self.kernel_backend = resolve_backend(kernel_backend)
        self.mesh = mesh
        self.embed = param(rngs, (v, d), ("vocab", "embed"), dtype)
        self.dense_layers = _stacked_layers(config.num_dense_layers, config, False, dtype, rngs, expert_dispatch)
        self.moe_layers = _stacked_layers(config.num_moe_layers, config, True, dtype, rngs, expert_dispatch)
        self.norm = RMSNorm(d, config.rms_norm_eps, "embed", dtype)
        self.lm_head = None if config.tie_word_embeddings else param(rngs, (d, v), ("embed", "vocab"), dtype)

    # ----- traced (call inside jit) ------------------------------------------------------------
    def __call__(self, tokens, *, mode: str = "expanded"):
        """Full causal forward, no cache: tokens i32[B, T] -> logits f32[B, T, vocab]."""
        backend = self.kernel_backend
        x = embed_lookup(self.embed[...], tokens)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        step = lambda stack: lambda layer, x, _, index: layer(x, positions, mode=mode, backend=backend,
                                                              stacked=self._stacked(stack, index))
        x = _scan_layers(self.dense_layers, x, 0, step(self.dense_layers))
        x = _scan_layers(self.moe_layers, x, self.config.num_dense_layers, step(self.moe_layers))
        return self.compute_logits(self.norm(x))

    def _stacked(self, stack, index) -> LayerStack | None:
        """``stack``'s weights for the kernels that read one layer in place (``LayerStack``); None with
        the reference backend."""
        if stack is None or self.kernel_backend == "reference":
            return None
        mlp, experts, router = stack.mlp, None, None
        if isinstance(mlp, MoE):
            experts, router = (mlp.w_gate[...], mlp.w_up[...], mlp.w_down[...]), mlp.router[...]
            mlp = mlp.shared
        attn = {**stack.attn.stacked_projections(index), "norm": stack.attn_norm.weight[...]}
        return LayerStack(index=index, attn=attn,
                          mlp=None if mlp is None else (mlp.w_gate[...], mlp.w_up[...], mlp.w_down[...]),
                          experts=experts, mlp_norm=stack.mlp_norm.weight[...], router=router)

    def forward_paged(self, tokens, cache: PagedKVCache, batch: PagedBatch):
        """One engine step over packed tokens i32[T]: writes their latents into the paged cache and
        returns (final-normed hidden states [T, D], updated cache). A one-token step on Hopper runs the MoE
        stack as one persistent kernel where ``step_kernel_blocker`` has no objection."""
        backend = self.kernel_backend

        def step(stack):
            def one(layer, carry, index, index_in_stack):
                x, cache = carry
                return layer.paged(x, cache, index, batch, backend=backend, stacked=self._stacked(stack, index_in_stack))
            return one

        x = embed_lookup(self.embed[...], tokens)
        if self.step_kernel_blocker(tokens.shape[0], cache, batch.block_tables.shape[-1]) is not None:
            # the MoE stack first in the cache's layer axis, the dense layers after it (see _scan_layers)
            carry = _scan_layers(self.dense_layers, (x, cache), self.config.num_moe_layers, step(self.dense_layers))
            x, cache = _scan_layers(self.moe_layers, carry, 0, step(self.moe_layers))
            return self.norm(x), cache
        if self.dense_attention_blocker() is None:  # (x unused where the kernel reads the token's row itself)
            x, dense_rows = self._dense_layer_step(x, cache, batch, tokens)
            return self._moe_stack_step(x, cache, batch, dense_rows)
        return self._moe_stack_step(
            *_scan_layers(self.dense_layers, (x, cache), self.config.num_moe_layers, step(self.dense_layers)), batch)

    def prepare_step_kernel(self) -> str | None:
        """Readies the MoE stack for the batch-1 step kernel (``decode_step_moe.moe_layer_chain``) where it
        may run (the pallas backend on Hopper, one device; whether steps take it is ``dispatch.STEP_KERNEL``'s
        and ``step_kernel_blocker``'s): the rope columns of its q_proj and kv_a in the
        [evens | odds] order the kernel rotates as halves (``decode_step_attention.permute_rope_columns``),
        the stack's rope then rotating halves too. Every path computes the same values as before. What the
        kernel would otherwise derive in every step is derived once here, as ``StepKernelCache`` variables:
        the router's bf16 parts (``decode_step_moe.router_parts``, ``moe_layers.mlp.router_parts``; 17.1 µs a
        step, decode_profile.md round 27) and the f32 weights of the stack's three RMSNorms (``weight_f32``
        beside each norm's weight; 7.8 µs a step, round 29). The dense layers' attention is readied the same way
        (``dense_attention_blocker``), and the final norm's f32 weights too (``dispatch.STEP_KERNEL_FINAL_NORM``).
        Call it again after changing the weights. -> None once ready, else why not. Idempotent."""
        if why_not := self._why_not_step_kernel():
            return why_not
        moe = self.moe_layers.mlp
        moe.router_parts = StepKernelCache(jax.jit(decode_step_moe.router_parts)(moe.router[...]))
        for stack in (self.moe_layers, self.dense_layers):  # the dense layers' attention too (dense_attention_blocker)
            if stack is None:
                continue
            attn = stack.attn
            if attn.interleave:
                attn.q_proj[...], attn.kv_a[...] = permute_rope_columns(attn.q_proj[...], attn.kv_a[...],
                                                                          attn.rope_dim, True)
                attn.interleave = False
            for norm in (stack.attn_norm, attn.kv_a_norm, stack.mlp_norm):
                norm.weight_f32 = StepKernelCache(jnp.asarray(norm.weight[...], jnp.float32))
        self.norm.weight_f32 = StepKernelCache(jnp.asarray(self.norm.weight[...], jnp.float32))  # the final norm's
        return None

    def _why_not_step_kernel(self, block_size: int = 64, capacity: int = 64) -> str | None:
        """The step kernel's conditions apart from ``dispatch.STEP_KERNEL`` and a step's token count and cache
        format, for pages of ``block_size`` and block tables of ``capacity`` tokens (by default the least the
        kernel takes)."""
        c = self.config
        if self.kernel_backend != "pallas":
            return f"kernel_backend={self.kernel_backend!r} (the kernel runs under 'pallas')"
        if self.mesh is not None:
            return "a mesh (the kernel runs on one device)"
        if self.moe_layers is None or self.moe_layers.attn.q_proj is None:
            return "no MoE layers, or a q LoRA (the kernel takes q_proj)"
        if (c.scoring_func, c.topk_method, c.n_routed_experts) != ("softmax", "greedy", 64):
            return (f"routing {c.scoring_func} / {c.topk_method} over {c.n_routed_experts} experts (the kernel's "
                    "router: softmax, greedy, 64 experts)")
        heads, dims = c.num_attention_heads, (c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim)
        return decode_step_moe.moe_supports(
            c.hidden_size, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts,
            c.num_moe_layers, self.dtype, router=True, num_experts=c.n_routed_experts, top_k=c.num_experts_per_tok,
            attention=heads * c.v_head_dim) or decode_step_attention.attention_supports(
            c.hidden_size, heads, dims, block_size, capacity, self.dtype, c.num_moe_layers)

    def step_kernel_blocker(self, num_tokens: int, cache: PagedKVCache, table_width: int) -> str | None:
        """None when a step of ``num_tokens`` over ``cache`` (block tables ``table_width`` pages wide) runs the
        MoE stack in one kernel (``prepare_step_kernel`` done), else why not."""
        if not dispatch.STEP_KERNEL:
            return "dispatch.STEP_KERNEL is off"
        if why_not := self._why_not_step_kernel(cache.block_size, table_width * cache.block_size):
            return why_not
        if (self.moe_layers.attn.interleave or not hasattr(self.moe_layers.mlp, "router_parts")
                or not hasattr(self.moe_layers.mlp_norm, "weight_f32") or not hasattr(self.norm, "weight_f32")):
            return "the stack's rope columns, router parts and f32 norms are not prepared (prepare_step_kernel)"
        if num_tokens != 1:
            return f"{num_tokens} tokens in the step (the kernel takes one)"
        if cache.c_kv_scale is not None or cache.pools is not None or cache.c_kv.dtype != self.dtype:
            return "an 8-bit or two-pool cache (the kernel reads one bf16 pool)"
        return None

    def dense_attention_blocker(self) -> str | None:
        """None when a step that runs the step kernel also runs the dense layer's attention half as one kernel
        (``dispatch.STEP_KERNEL_DENSE_ATTENTION``), else why not."""
        if not dispatch.STEP_KERNEL_DENSE_ATTENTION:
            return "dispatch.STEP_KERNEL_DENSE_ATTENTION is off"
        if self.config.num_dense_layers != 1:
            return f"{self.config.num_dense_layers} dense layers (the kernel's path takes one)"
        if self.dense_layers.attn.interleave or not hasattr(self.dense_layers.attn_norm, "weight_f32"):
            return "the dense layer's rope columns and f32 norms are not prepared (prepare_step_kernel)"
        return None

    @staticmethod
    def _attention_weights(stack):
        """``stack``'s attention as the step kernels take it (``prepare_step_kernel`` done) -> (weights, spec)."""
        attn = stack.attn
        weights = decode_step_attention.AttentionWeights(
            stack.attn_norm.weight_f32[...], attn.q_proj[...], attn.kv_a[...], attn.kv_a_norm.weight_f32[...],
            attn.w_uk[...], attn.w_uv[...], attn.o_proj[...])
        spec = decode_step_attention.AttentionSpec(stack.attn_norm.eps, attn.kv_a_norm.eps, attn.scale,
                                                   attn.inv_freq, attn.cos_sin_scale)
        return weights, spec

    def _dense_layer_step(self, x, cache: PagedKVCache, batch: PagedBatch, tokens):
        """The dense layer of a one-token step: its attention half as one persistent kernel
        (``decode_step_attention.attention_chain`` over its cache layer, after the MoE stack's) that also norms its
        output for the MLP where the expert launch takes the MLP (``dispatch.dense_mlp_decode``; elsewhere the
        layer scan runs the MLP). x [1, D] -> (x after the layer, its new cache row [1, 576], which the caller
        stores with the MoE stack's); x in f32, unrounded, where the expert launch adds into the attention's output
        in place (``dispatch.DENSE_MLP_IN_PLACE``: the step kernel rounds it as it reads it). With
        ``dispatch.STEP_KERNEL_EMBEDDING`` the kernel reads the token's (``tokens`` [1]) embedding row itself and x,
        the row looked up before, goes unused (XLA drops its lookup)."""
        stack, backend, mlp_norm = self.dense_layers, self.kernel_backend, self.dense_layers.mlp_norm
        w_gate, w_up, w_down = stack.mlp.w_gate[...], stack.mlp.w_up[...], stack.mlp.w_down[...]
        expert_launch = dispatch.dense_mlp_mgpu_takes(x, w_gate, backend)  # the layer's output has x's shape
        in_place = expert_launch and dispatch.DENSE_MLP_IN_PLACE  # the launch adds into h (f32), x comes back f32
        embedding = self.embed[...] if dispatch.STEP_KERNEL_EMBEDDING else None
        h, row, *normed = decode_step_attention.attention_chain(
            x[0] if embedding is None else tokens[0], batch.positions[0], batch.block_tables[batch.seq_ids[0]],
            cache.c_kv, cache.k_pe, *self._attention_weights(stack), cache_layer=self.config.num_moe_layers,
            out_norm=(mlp_norm.weight_f32[...][0], mlp_norm.eps) if expert_launch else None,
            residual_dtype=jnp.float32 if in_place else None, embedding=embedding,
            launch_dependents=expert_launch and dispatch.STEP_KERNEL_PDL)
        h = h[None]
        if expert_launch:  # the kernel's tail normed h for it
            return dispatch.dense_mlp_decode(normed[0][None], w_gate, w_up, w_down, 0, residual=h,
                                             in_place=in_place, pdl=dispatch.STEP_KERNEL_PDL), row
        mlp = lambda layer, h, _, index: layer.mlp_paged(h, backend=backend, stacked=self._stacked(stack, index))
        return _scan_layers(stack, h, self.config.num_moe_layers, mlp), row

    def _moe_stack_step(self, x, cache: PagedKVCache, batch: PagedBatch, dense_rows=None):
        """The MoE stack of a one-token step as one persistent kernel: x [1, D] -> (the hidden state after the stack,
        final-normed (in the kernel's tail with ``dispatch.STEP_KERNEL_FINAL_NORM``), and the cache with every MoE
        layer's new latent and rope key at the token's slot, ``dense_rows`` [Ld, 576] at the dense layers' after
        them when given, all in one store)."""
        stack, c = self.moe_layers, self.config
        moe = stack.mlp
        shared = (moe.shared.w_gate[...], moe.shared.w_up[...], moe.shared.w_down[...])
        out, _, _, kv = decode_step_moe.moe_layer_chain(
            x[0], batch.positions[0], batch.block_tables[batch.seq_ids[0]], cache.c_kv, cache.k_pe,
            *self._attention_weights(stack), stack.mlp_norm.weight_f32[...], moe.router_parts[...],
            decode_step_moe.RouterSpec(stack.mlp_norm.eps, c.norm_topk_prob, c.routed_scaling_factor),
            c.num_experts_per_tok, moe.w_gate[...], moe.w_up[...], moe.w_down[...], shared,
            profile_dir=dispatch.STEP_KERNEL_TRACE,
            final_norm=(self.norm.weight_f32[...], self.norm.eps) if dispatch.STEP_KERNEL_FINAL_NORM else None,
            pdl=dispatch.STEP_KERNEL_PDL)
        rows = kv if dense_rows is None else (kv, dense_rows)  # the cache's layers in order: the stack's, the dense
        c_kv, k_pe = dispatch.store_rows(cache.c_kv, cache.k_pe, rows, batch.slot_mapping[0], self.kernel_backend)
        hidden = out[None] if dispatch.STEP_KERNEL_FINAL_NORM else self.norm(out[None])
        return hidden, cache._replace(c_kv=c_kv, k_pe=k_pe)

    def compute_logits(self, hidden):
        """hidden [..., D] (final-normed) -> f32[..., vocab] (the whole vocabulary on every tensor rank)."""
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return gather_vocab(jnp.dot(hidden, head, preferred_element_type=jnp.float32))

    # ----- host ----------------------------------------------------------------------------------
    def logits(self, token_ids, *, mode: str = "expanded"):
        """int32 [B, T] -> float32 [B, T, vocab]; full causal forward without a cache."""
        tokens = jnp.asarray(token_ids, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"token_ids must be 2-D [batch, length], got shape {tokens.shape}")
        graphdef, state = nnx.split(self)
        if self.mesh is None:
            return _full_forward_jit(self.kernel_backend)(graphdef, state, tokens, mode, None)
        # Sequences split over the data-parallel ranks: pad the batch to a multiple of them.
        batch = tokens.shape[0]
        shards = num_batch_shards(self.mesh)
        host = np.zeros((-(-batch // shards) * shards, tokens.shape[1]), np.int32)
        host[:batch] = np.asarray(token_ids, np.int32)
        tokens = jax.device_put(host, NamedSharding(self.mesh, batch_spec(2)))
        return _full_forward_jit(self.kernel_backend)(graphdef, state, tokens, mode, self.mesh)[:batch]


@functools.cache
def _full_forward_jit(kernel_backend: str):
    """The no-cache forward jitted once a backend, with its XLA options (dispatch.compiler_options)."""
    return jax.jit(_full_forward, static_argnums=(0, 3, 4), compiler_options=dispatch.compiler_options(kernel_backend))


def _full_forward(graphdef, state, tokens, mode, mesh):
    model = nnx.merge(graphdef, state)
    if mesh is None:
        return model(tokens, mode=mode)
    local = lambda state, tokens: nnx.merge(graphdef, state)(tokens, mode=mode)
    return jax.shard_map(local, mesh=mesh, in_specs=(param_specs(state), batch_spec(2)), out_specs=batch_spec(3),
                         check_vma=checks_vma(model.kernel_backend))(state, tokens)


def abstract_model(config: ModelConfig, *, dtype="float32", kernel_backend: str = "auto",
                   mesh: Mesh | None = None, expert_dispatch: ExpertDispatch = ExpertDispatch()):
    """The model's structure with ShapeDtypeStruct leaves: nothing allocated."""
    return nnx.eval_shape(lambda: DeepseekForCausalLM(config, dtype=dtype, kernel_backend=kernel_backend, mesh=mesh,
                                                      expert_dispatch=expert_dispatch, rngs=nnx.Rngs(0)))


def state_shardings(model_or_state, mesh: Mesh | None):
    """NamedShardings of every weight on ``mesh`` (None without one)."""
    if mesh is None:
        return None
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    return param_shardings(state, mesh)


def random_model(config: ModelConfig, *, dtype="float32", kernel_backend: str = "auto", seed: int = 0,
                 mesh: Mesh | None = None, expert_dispatch: ExpertDispatch = ExpertDispatch()):
    """Deterministic random weights: normal(0, 0.02) like transformers' init, norms 1, router bias 0.

    One jitted program whose outputs are the weights' shards. Each number is a pure function of
    (seed, weight, coordinates) (``_hashed_normal``), so every device computes only its own shard,
    the values do not depend on the mesh, and no device ever holds a weight it does not own.
    """
    model = abstract_model(config, dtype=dtype, kernel_backend=kernel_backend, mesh=mesh,
                           expert_dispatch=expert_dispatch)
    graphdef, abstract = nnx.split(model)
    state_shardings(abstract, mesh)  # refuses a mesh that cannot split some weight evenly
    leaves, treedef = jax.tree.flatten_with_path(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    plan = tuple((_init_kind(path), v.shape, jnp.dtype(v.dtype), logical_axes(v)) for path, v in leaves)
    values = _random_init(plan, mesh)(jnp.uint32(seed & 0xFFFFFFFF))
    state = jax.tree.unflatten(treedef, [v.replace(x) for (_, v), x in zip(leaves, values)])
    return nnx.merge(graphdef, state)


def _init_kind(path) -> str:
    name = str(path[-1].key)
    return {"score_bias": "zeros", "weight": "ones"}.get(name, "normal")  # "weight": RMSNorm scales


@functools.lru_cache(maxsize=8)
def _random_init(plan, mesh):
    """The jitted initializer for a model's (kind, shape, dtype, logical axes) leaves on ``mesh``."""
    shardings = None if mesh is None else [NamedSharding(mesh, logical_to_spec(axes)) for *_, axes in plan]

    def one(seed, index, kind, shape, dtype):
        if kind != "normal":
            return (jnp.zeros if kind == "zeros" else jnp.ones)(shape, dtype)
        key = _mix32(seed ^ jnp.uint32(index * _GOLDEN & 0xFFFFFFFF))  # one key per weight
        return (INIT_STD * _hashed_normal(key, shape)).astype(dtype)

    def init(seed):
        return [one(seed, index, kind, shape, dtype) for index, (kind, shape, dtype, _) in enumerate(plan)]

    return jax.jit(init, out_shardings=shardings)


_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive integers over the 32-bit range


def _mix32(h):
    """murmur3's 32-bit finalizer: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hashed_normal(key, shape):
    """f32 standard normals, element i = f(key, coordinates of i): the key is hashed with each
    coordinate in turn (no flat index, so no 32-bit overflow on huge weights), then two 24-bit
    uniforms go through Box-Muller. Elementwise over iotas, so XLA partitions it like any other
    elementwise op, and a few integer ops per number compile far faster than threefry."""
    h = jnp.full(shape, key, jnp.uint32)
    for dim in range(len(shape)):
        h = _mix32(h ^ jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(_GOLDEN))
    to_unit = lambda bits: (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))  # [0, 1)
    u1 = to_unit(_mix32(h ^ jnp.uint32(0x68E31DA4))) + 0.5 / (1 << 24)  # (0, 1): log is finite
    u2 = to_unit(_mix32(h ^ jnp.uint32(0xB5297A4D)))
    return jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(2.0 * np.pi * u2)
