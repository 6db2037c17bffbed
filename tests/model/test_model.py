"""Model structure: logical axes, presets' determinism, backends, and cached (paged) decoding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsjax
from dsjax.model import PagedBatch, PagedKVCache, abstract_model, random_model
from dsjax.model.dispatch import compiler_options, resolve_backend
from dsjax.model.params import logical_axes

AXES = {"layers", "vocab", "embed", "heads", "q_lora", "kv_lora", "qk_head", "v_head", "mlp", "expert",
        "moe_mlp", None}


def test_every_parameter_has_logical_axes():
    model = dsjax.load_model("tiny")
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = logical_axes(variable)
        assert len(axes) == variable.shape.__len__(), path
        assert set(axes) <= AXES, (path, axes)
        if path[0].endswith("_layers"):
            assert axes[0] == "layers"


def test_preset_weights_are_deterministic():
    a, b = dsjax.load_model("tiny"), dsjax.load_model("tiny")
    tokens = np.arange(12, dtype=np.int32)[None] + 3
    np.testing.assert_array_equal(np.asarray(a.logits(tokens)), np.asarray(b.logits(tokens)))
    c = dsjax.load_model("tiny", seed=1)
    assert not np.allclose(np.asarray(a.logits(tokens)), np.asarray(c.logits(tokens)))


def test_backend_resolution():
    assert resolve_backend("auto") == ("pallas" if jax.default_backend() == "gpu" else "reference")
    with pytest.raises(ValueError, match="kernel_backend='cuda' is not supported; accepted: reference, pallas"):
        resolve_backend("cuda")


def _paged_logits(model, tokens, chunks, block_size=4, num_blocks=32, cache_dtype=jnp.float32):
    """Logits of ``tokens`` fed through forward_paged in the given (start, stop) chunks, into a shuffled
    paged cache."""
    table = np.random.default_rng(1).permutation(num_blocks)[:-(-len(tokens) // block_size)].astype(np.int32)
    cache = PagedKVCache.zeros(model.config, num_blocks, block_size, cache_dtype)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, compiler_options=compiler_options(model.kernel_backend))
    def step(state, cache, toks, positions):
        m = nnx.merge(graphdef, state)
        slots = jnp.asarray(table)[positions // block_size] * block_size + positions % block_size
        batch = PagedBatch(positions, slots, jnp.zeros_like(positions), jnp.asarray(table)[None])
        hidden, cache = m.forward_paged(toks, cache, batch)
        return m.compute_logits(hidden), cache

    got = []
    for start, stop in chunks:
        logits, cache = step(state, cache, jnp.asarray(tokens[start:stop]), jnp.arange(start, stop, dtype=jnp.int32))
        got.append(np.asarray(logits))
    return np.concatenate(got)


def test_paged_forward_matches_full_forward():
    """Prefill a prompt in two chunks into a shuffled paged cache, then decode: every position's
    logits equal the no-cache forward."""
    model = dsjax.load_model("tiny")
    tokens = np.random.default_rng(0).integers(3, 259, size=21).astype(np.int32)
    full = np.asarray(model.logits(tokens[None]))[0]
    got = _paged_logits(model, tokens, [(0, 9), (9, 17)] + [(i, i + 1) for i in range(17, 21)])
    assert np.abs(got - full).max() <= 1e-4 * np.abs(full).max()


@pytest.mark.parametrize("q_lora_rank, norm_in_route, residual_in_sum",
                         [(None, True, True), (96, True, True), (None, False, False)])
def test_paged_decode_kernels_match_reference(q_lora_rank, norm_in_route, residual_in_sum, monkeypatch):
    """The kernels' paged forward (interpret mode) equals the reference backend's: a 70-token chunk
    (XLA's projections, over STACKED_GEMV_MAX_TOKENS) and steps of 3 and 1 tokens (each sublayer's
    RMSNorm fused into one stacked-GEMV launch with q / q_a and kv_a, or with the router and the
    shared experts' gate and up; the 1-token step runs routed and shared experts in one launch,
    pallas_kernels/moe_decode.py), with a q LoRA (q_b's launch fuses q_a_norm) and without (q_proj);
    norm_in_route: the 1-token step's MoE norm finished in the routing kernel
    (dispatch.ROUTER_NORM_IN_ROUTE, on as built) or in the stacked GEMV; residual_in_sum: its residual
    added by the experts' launch (MOE_DECODE_RESIDUAL_MAX_TOKENS, on as built: a residual added twice
    or not at all fails it); the third case turns both off; with the q LoRA the normed rows come from programs of their own
    (ROUTE_ROWS_PROGRAMS)."""
    import dataclasses

    from dsjax.config import ModelConfig
    from dsjax.model import dispatch

    monkeypatch.setattr(dispatch, "ROUTER_NORM_IN_ROUTE", norm_in_route)
    monkeypatch.setattr(dispatch, "MOE_DECODE_RESIDUAL_MAX_TOKENS", int(residual_in_sum))
    monkeypatch.setattr(dispatch, "ROUTE_ROWS_PROGRAMS", 4 if q_lora_rank else 0)  # the normed rows' own programs

    config = dataclasses.replace(ModelConfig.preset("tiny"), q_lora_rank=q_lora_rank)
    tokens = np.random.default_rng(0).integers(3, 259, size=74).astype(np.int32)
    chunks = [(0, 70), (70, 73), (73, 74)]
    # random_model: the weights in one jitted program (eager init compiles a program per weight shape)
    logits = {backend: _paged_logits(random_model(config, kernel_backend=backend), tokens, chunks)
              for backend in ("reference", "interpret")}
    scale = np.abs(logits["reference"]).max()
    assert np.abs(logits["interpret"] - logits["reference"]).max() <= 1e-4 * scale


def test_one_token_experts_take_the_mosaic_launch_where_it_fits(monkeypatch):
    """dispatch.MOE_DECODE_MGPU: on the pallas backend a one-token step whose layer the TMA-fed Mosaic
    launch supports goes there (residual and shared experts passed on); two tokens, another backend,
    the knob off, or a layer it refuses keep the Triton launch."""
    from dsjax.model import dispatch
    from pallas_kernels import moe_decode_mgpu

    calls = []
    monkeypatch.setattr(moe_decode_mgpu, "moe_decode_mgpu", lambda *a: calls.append(("mgpu", a)) or "mgpu")
    monkeypatch.setattr(dispatch, "moe_decode_kernel", lambda *a, **k: calls.append(("triton", a)) or "triton")
    refusal = {"reason": None}
    monkeypatch.setattr(moe_decode_mgpu, "supports", lambda *a: refusal["reason"])
    experts = tuple(jnp.zeros(s, jnp.bfloat16) for s in ((2, 4, 128, 64), (2, 4, 128, 64), (2, 4, 64, 128)))
    shared = tuple(jnp.zeros(s, jnp.bfloat16) for s in ((2, 128, 64), (2, 128, 64), (2, 64, 128)))
    one, two = jnp.zeros((1, 128), jnp.bfloat16), jnp.zeros((2, 128), jnp.bfloat16)
    step = lambda x, backend="pallas": dispatch.moe_decode(x, jnp.ones((x.shape[0], 2)), jnp.zeros((x.shape[0], 2),
                                                                                                   jnp.int32),
                                                           experts, shared, 1, backend, residual=x)
    monkeypatch.setattr(dispatch, "MOE_DECODE_MGPU", False)
    assert step(one) == "triton"
    monkeypatch.setattr(dispatch, "MOE_DECODE_MGPU", True)
    assert step(one) == "mgpu"
    assert calls[-1][1][-2] is shared and calls[-1][1][-1] is one  # the shared experts, the residual
    assert step(one, "interpret") == "triton"
    refusal["reason"] = "2 tokens (this kernel takes one)"
    assert step(two) == "triton"
    refusal["reason"] = "not on a GPU"
    assert step(one) == "triton"


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_stacked_mlp_kernels_read_their_layer(num_tokens):
    """The dense / shared-expert MLP of one layer, taken from every layer's stacked weights by the
    stacked GEMV (interpret mode; up to its 64 rows), equals that layer's SwiGLU MLP; 96 columns leave a
    partial tile."""
    from dsjax.model import dispatch

    layers, hidden, inter = 3, 64, 96
    keys = jax.random.split(jax.random.key(4), 4)
    x = jax.random.normal(keys[0], (num_tokens, hidden), jnp.float32)
    w_gate, w_up = (jax.random.normal(k, (layers, hidden, inter), jnp.float32) * 0.1 for k in keys[1:3])
    w_down = jax.random.normal(keys[3], (layers, inter, hidden), jnp.float32) * 0.1
    for layer in range(layers):
        h = jax.nn.silu(x @ w_gate[layer]) * (x @ w_up[layer])
        got = jax.jit(dispatch.stacked_mlp, static_argnames="backend")(x, w_gate, w_up, w_down, jnp.int32(layer),
                                                                     backend="interpret")
        np.testing.assert_allclose(got, h @ w_down[layer], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("add_residual", [False, True])
def test_dense_mlp_through_the_expert_launch_is_the_layers_mlp(add_residual, monkeypatch):
    """dispatch.DENSE_MLP_MGPU: a one-token dense MLP goes to the expert launch (``moe_decode_mgpu``, here its
    reference, which takes the same arguments) as the one expert of a one-expert view of its stacks, weight 1,
    the layer's RMSNorm first and x added as the residual: the same as the stacked GEMVs' path."""
    from dsjax.model import dispatch
    from dsjax.model.moe import MLP
    from dsjax.model.transformer import LayerStack
    from pallas_kernels import moe_decode_mgpu
    from pallas_kernels.moe_decode import moe_decode_reference

    layers, hidden, inter = 3, 64, 128
    keys = jax.random.split(jax.random.key(6), 5)
    x = jax.random.normal(keys[0], (1, hidden), jnp.float32) * 3
    w_gate, w_up = (jax.random.normal(k, (layers, hidden, inter), jnp.float32) * 0.1 for k in keys[1:3])
    w_down = jax.random.normal(keys[3], (layers, inter, hidden), jnp.float32) * 0.1
    norm = 1 + 0.1 * jax.random.normal(keys[4], (layers, hidden), jnp.float32)
    mlp = MLP(hidden, inter, jnp.float32, nnx.Rngs(0))
    stack = LayerStack(index=jnp.int32(1), attn={}, mlp=(w_gate, w_up, w_down), experts=None, mlp_norm=norm,
                       router=None)
    want = mlp.decode(x, stack, 1e-6, "reference", add_residual=add_residual)
    calls = []

    def launch(*args, residual=None, in_place, pdl):
        calls.append(args)
        assert not in_place and not pdl  # the layer scan's MLP: its partial rows summed after it, launched as usual
        return moe_decode_reference(*args, None, residual)

    monkeypatch.setattr(dispatch, "DENSE_MLP_MGPU", False)
    assert not dispatch.dense_mlp_mgpu_takes(x, w_gate, "pallas")  # the knob off
    monkeypatch.setattr(dispatch, "DENSE_MLP_MGPU", True)  # on as built
    assert not dispatch.dense_mlp_mgpu_takes(x, w_gate, "reference")
    monkeypatch.setattr(dispatch, "dense_mlp_mgpu_takes", lambda x, w, backend: True)
    monkeypatch.setattr(moe_decode_mgpu, "moe_decode_mgpu", launch)
    got = mlp.decode(x, stack, 1e-6, "reference", add_residual=add_residual)
    (args,) = calls
    _, weights, ids, gate, up, down, layer = args
    assert gate.shape == (layers, 1, hidden, inter) and down.shape == (layers, 1, inter, hidden) and int(layer) == 1
    assert weights.tolist() == [[1.0]] and ids.tolist() == [[0]]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("num_tokens, folded", [(1, True), (8, True), (9, False)])
def test_few_token_steps_fold_w_uk_into_the_latent_write(num_tokens, folded, monkeypatch):
    """Up to dispatch.QUERY_FOLD_MAX_TOKENS tokens (no q LoRA) write_latents absorbs the queries through
    W_UK, so W_UK has no per-head GEMV launch of its own (half of them, against the same step with the
    fold off); W_UV keeps its launch at every size (the numbers: test_paged_decode_kernels_match_reference)."""
    import dataclasses

    from dsjax.config import ModelConfig
    from dsjax.model import dispatch

    assert dispatch.QUERY_FOLD_MAX_TOKENS == 8
    config = dataclasses.replace(ModelConfig.preset("tiny"), q_lora_rank=None)
    cache = PagedKVCache.zeros(config, 64, 4, jnp.float32)

    def launches():  # a fresh model each time: its jitted layer bodies are traced anew under the knob
        graphdef, state = nnx.split(abstract_model(config, kernel_backend="interpret"))  # traced, never run

        def step(state, cache, toks):
            positions = jnp.arange(toks.shape[0], dtype=jnp.int32)
            batch = PagedBatch(positions, positions, jnp.zeros_like(positions), jnp.arange(64, dtype=jnp.int32)[None])
            return nnx.merge(graphdef, state).forward_paged(toks, cache, batch)

        jaxpr = str(jax.make_jaxpr(step)(state, cache, jnp.zeros(num_tokens, jnp.int32)))
        return jaxpr.count("jaxpr=write_latents_q_uk"), jaxpr.count("jaxpr=stacked_head_gemv")

    (absorbing, head_gemvs) = launches()
    monkeypatch.setattr(dispatch, "QUERY_FOLD_MAX_TOKENS", 0)
    (_, head_gemvs_unfolded) = launches()
    assert (absorbing > 0) == folded
    assert head_gemvs * (2 if folded else 1) == head_gemvs_unfolded > 0


@pytest.mark.parametrize("rows_backend, dense_attention, final_norm, in_place", [
    ("reference", False, False, False), ("interpret", False, False, False), ("reference", True, True, False),
    ("reference", True, True, True)])
def test_one_token_steps_run_the_moe_stack_as_one_kernel(monkeypatch, rows_backend, dense_attention, final_norm,
                                                         in_place):
    """The batch-1 step kernel's wiring (DeepseekForCausalLM.prepare_step_kernel, step_kernel_blocker,
    _moe_stack_step) on the CPU: with the kernel's jnp reference in its place (moe_layer_chain_reference, the
    model's attention and MoE half a layer; the kernel itself is checked against it on the GPU) and its shape
    checks waived for a tiny V2-Lite-like model, a prompt prefilled and then decoded one token a step gives the
    logits of the model as loaded (later steps read the cache rows earlier ones wrote); steps of several tokens
    keep the layer scan. The kernel's rows go into the cache by ``dispatch.store_rows``: its reference, or the
    Triton store (``latent_write.store_rows``) in interpret mode. With ``dispatch.STEP_KERNEL_DENSE_ATTENTION`` the
    dense layer's attention half runs as its own kernel too (``attention_chain_reference`` in its place, over the
    dense layer's cache layer after the stack's), its row stored with the stack's; with
    ``dispatch.STEP_KERNEL_FINAL_NORM`` the kernel returns x_L final-normed; with ``dispatch.DENSE_MLP_IN_PLACE`` the
    attention kernel's output comes in f32, the expert launch adds into it in place and hands the step kernel the
    f32 sum; with ``dispatch.STEP_KERNEL_EMBEDDING`` (the same case) the attention kernel takes the token's id and
    the embedding table; with ``dispatch.STEP_KERNEL_PDL`` (the same case) the three kernels are told to run as
    programmatic dependent launches."""
    import dataclasses

    from dsjax.config import ModelConfig
    from dsjax.model import dispatch
    from dsjax.model.transformer import DeepseekForCausalLM
    from pallas_kernels import decode_step_attention, decode_step_moe

    config = dataclasses.replace(ModelConfig.preset("tiny"), q_lora_rank=None, topk_method="greedy",
                                 scoring_func="softmax", n_group=1, topk_group=1, norm_topk_prob=False,
                                 routed_scaling_factor=1.0)
    model = random_model(config, kernel_backend="reference", seed=3)
    tokens = np.random.default_rng(2).integers(3, 259, size=11).astype(np.int32)
    chunks = [(0, 7)] + [(i, i + 1) for i in range(7, 11)]
    want = _paged_logits(model, tokens, chunks)
    assert "kernel_backend='reference'" in model.prepare_step_kernel()
    calls, traces, finals, pdls = [], [], [], []

    def chain(*args, profile_dir=None, final_norm=None, pdl):
        calls.append(args[0].shape)
        pdls.append(("step kernel", pdl))
        traces.append(profile_dir)  # dispatch.STEP_KERNEL_TRACE, passed through
        finals.append(None if final_norm is None else (str(final_norm[0].dtype), final_norm[1]))
        return decode_step_moe.moe_layer_chain_reference(*args, final_norm=final_norm)

    monkeypatch.setattr(DeepseekForCausalLM, "_why_not_step_kernel", lambda self, *shapes: None)
    monkeypatch.setattr(decode_step_attention, "attention_supports", lambda *a: None)
    monkeypatch.setattr(decode_step_moe, "moe_layer_chain", chain)
    dense_calls = []

    def dense_chain(*args, cache_layer, out_norm, residual_dtype, embedding, launch_dependents, profile_dir=None):
        pdls.append(("attention", launch_dependents))
        dense_calls.append((args[0].shape, args[5].norm.shape, cache_layer, out_norm[0].shape, residual_dtype,
                            None if embedding is None else (str(args[0].dtype), embedding.shape)))
        return decode_step_attention.attention_chain_reference(*args, cache_layer=cache_layer, out_norm=out_norm,
                                                               residual_dtype=residual_dtype, embedding=embedding)

    monkeypatch.setattr(decode_step_attention, "attention_chain", dense_chain)
    # the dense MLP of a one-token step by the expert launch (its reference here) on the chain's normed output
    from pallas_kernels import moe_decode, moe_decode_mgpu

    mlp_calls, dense_mlp_decode = [], dispatch.dense_mlp_decode
    monkeypatch.setattr(dispatch, "dense_mlp_mgpu_takes", lambda x, w_gate, backend: x.shape[0] == 1)
    launches = []

    def expert_launch(*args, in_place, pdl, **kwargs):  # in place: the f32 sum, unrounded
        pdls.append(("expert launch", pdl))
        launches.append(("in place", str(kwargs["residual"].dtype)) if in_place else "summed after")
        out = moe_decode.moe_decode_reference(*args, **kwargs)
        return out.astype(jnp.float32) if in_place else out

    monkeypatch.setattr(moe_decode_mgpu, "moe_decode_mgpu", expert_launch)
    monkeypatch.setattr(dispatch, "DENSE_MLP_IN_PLACE", in_place)
    monkeypatch.setattr(dispatch, "STEP_KERNEL_EMBEDDING", in_place)  # the kernel reading the token's row too
    monkeypatch.setattr(dispatch, "STEP_KERNEL_PDL", in_place)  # and the three kernels as dependent launches
    monkeypatch.setattr(dispatch, "dense_mlp_decode", lambda normed, *a, **k: mlp_calls.append(
        normed.shape) or dense_mlp_decode(normed, *a, **k))
    monkeypatch.setattr(dispatch, "STEP_KERNEL_DENSE_ATTENTION", dense_attention)
    monkeypatch.setattr(dispatch, "STEP_KERNEL_FINAL_NORM", final_norm)
    stores, store_rows = [], dispatch.store_rows

    def store(c_kv, k_pe, rows, slot, backend):
        stores.append((tuple(part.shape for part in (rows if isinstance(rows, tuple) else (rows,))), backend))
        return store_rows(c_kv, k_pe, rows, slot, rows_backend)

    monkeypatch.setattr(dispatch, "store_rows", store)
    monkeypatch.setattr(dispatch, "STEP_KERNEL", False)
    assert model.step_kernel_blocker(1, PagedKVCache.zeros(config, 4, 4, jnp.float32), 4) == (
        "dispatch.STEP_KERNEL is off")
    monkeypatch.setattr(dispatch, "STEP_KERNEL", True)
    monkeypatch.setattr(dispatch, "STEP_KERNEL_TRACE", "/tmp/step_kernel_trace")
    assert model.step_kernel_blocker(1, PagedKVCache.zeros(config, 4, 4, jnp.float32), 4) == (
        "the stack's rope columns, router parts and f32 norms are not prepared (prepare_step_kernel)")
    if dense_attention:
        assert model.dense_attention_blocker() == (
            "the dense layer's rope columns and f32 norms are not prepared (prepare_step_kernel)")
    assert model.prepare_step_kernel() is None and not model.moe_layers.attn.interleave
    assert not model.dense_layers.attn.interleave and model.dense_layers.attn_norm.weight_f32[...].dtype == jnp.float32
    assert model.dense_attention_blocker() == (None if dense_attention else
                                               "dispatch.STEP_KERNEL_DENSE_ATTENTION is off")
    assert model.prepare_step_kernel() is None  # idempotent: permuted once
    parts, router = model.moe_layers.mlp.router_parts[...], model.moe_layers.mlp.router[...]
    assert parts.shape == (router.shape[0], 2, *router.shape[1:]) and parts.dtype == jnp.bfloat16
    np.testing.assert_allclose(parts.astype(jnp.float32).sum(axis=1), router, rtol=2e-5, atol=1e-9)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))["moe_layers"]
    assert "router_parts" not in params["mlp"]
    stack = model.moe_layers
    for name, norm in (("attn_norm", stack.attn_norm), ("mlp_norm", stack.mlp_norm)):  # f32 copies, not Params
        assert norm.weight_f32[...].dtype == jnp.float32 and "weight_f32" not in params[name]
        np.testing.assert_array_equal(norm.weight_f32[...], norm.weight[...].astype(jnp.float32))
    assert stack.attn.kv_a_norm.weight_f32[...].shape == stack.attn.kv_a_norm.weight[...].shape
    assert "2 tokens in the step" in model.step_kernel_blocker(2, PagedKVCache.zeros(config, 4, 4, jnp.float32), 4)
    got = _paged_logits(model, tokens, chunks)
    # the one-token step, not the 7-token prefill: traced once (or twice with the interpret-mode store, whose first
    # run in a process changes JAX's tracing context)
    assert calls in ([(config.hidden_size,)], [(config.hidden_size,)] * (1 if rows_backend == "reference" else 2))
    assert set(traces) == {"/tmp/step_kernel_trace"}
    assert set(finals) == ({("float32", config.rms_norm_eps)} if final_norm else {None})
    width = config.kv_lora_rank + config.qk_rope_head_dim  # the stack's rows and the dense layer's, in one launch
    parts = ((config.num_moe_layers, width), (1, width)) if dense_attention else ((config.num_moe_layers, width),)
    assert set(stores) == {(parts, "reference")}
    embedded = ("int32", (config.vocab_size, config.hidden_size))  # the token's id and the table, with in_place
    assert set(dense_calls) == ({(() if in_place else (config.hidden_size,), (1, config.hidden_size),
                                  config.num_moe_layers, (config.hidden_size,), jnp.float32 if in_place else None,
                                  embedded if in_place else None)} if dense_attention else set())
    assert set(mlp_calls) == ({(1, config.hidden_size)} if dense_attention else set())  # the chain's normed output
    assert set(launches) == ({("in place", "float32")} if in_place else {"summed after"} if dense_attention else set())
    assert set(pdls) == {(kernel, in_place) for kernel in ("step kernel",) + (
        ("attention", "expert launch") if dense_attention else ())}
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("knobs", ["off", "session 49", "built"])
def test_one_token_forward_lowers_for_hopper_with_the_step_kernels(monkeypatch, knobs):
    """V2-Lite's one-token paged forward, weights readied (prepare_step_kernel, traced abstractly), lowered for an
    abstract H200: the MoE stack as the step kernel, the dense layer's MLP by the expert launch, and its attention
    half either as one more persistent kernel (dispatch.STEP_KERNEL_DENSE_ATTENTION) whose row joins the stack's
    in one Triton store, or as the six Triton launches (norm + q / kv_a, the latent's write, decode, combine, W_UV,
    o_proj) before the store ("off": the path of models the dense kernel does not take). With session 49's two
    knobs the dense MLP's norm comes from the attention kernel's tail and the final norm from the step kernel's
    (dispatch.STEP_KERNEL_FINAL_NORM): no RMSNorm is left outside the kernels, where without them two are. As
    built, with decode_step_attention.ROPE_IN_KERNEL, dispatch.DENSE_MLP_IN_PLACE and
    dispatch.STEP_KERNEL_EMBEDDING too, no cos / sin, no sum of the expert launch's partial rows and no embedding
    lookup either; with dispatch.STEP_KERNEL_PDL, the expert launch and the step kernel launched as programmatic
    dependents. The glue at the real shapes with the real kernels, no GPU needed."""
    from dsjax.config import ModelConfig
    from dsjax.model import dispatch
    from dsjax.model.transformer import DeepseekForCausalLM
    from pallas_kernels import (common, decode_step_attention, decode_step_mgpu, decode_step_moe, mla_decode_mgpu,
                                moe_decode_mgpu)

    for module in (decode_step_attention, decode_step_moe, decode_step_mgpu, moe_decode_mgpu, mla_decode_mgpu):
        monkeypatch.setattr(module, "why_not_hopper", lambda: None)
    monkeypatch.setattr(dispatch, "STEP_KERNEL", True)
    if knobs != "built":  # as built every one is on
        dense_attention = knobs == "session 49"
        monkeypatch.setattr(dispatch, "STEP_KERNEL_DENSE_ATTENTION", dense_attention)
        monkeypatch.setattr(dispatch, "STEP_KERNEL_FINAL_NORM", dense_attention)
        monkeypatch.setattr(decode_step_attention, "ROPE_IN_KERNEL", False)
        monkeypatch.setattr(dispatch, "DENSE_MLP_IN_PLACE", False)
        monkeypatch.setattr(dispatch, "STEP_KERNEL_EMBEDDING", False)
    config = ModelConfig.preset("deepseek-v2-lite")

    def ready():
        model = DeepseekForCausalLM(config, dtype="bfloat16", kernel_backend="pallas", rngs=nnx.Rngs(0))
        assert model.prepare_step_kernel() is None
        return model

    graphdef, state = nnx.split(nnx.eval_shape(ready))
    shape, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cache = PagedKVCache(shape((27, 64, 64, 512), bf16), shape((27, 64, 64, 64), bf16))
    batch = PagedBatch(shape((1,), i32), shape((1,), i32), shape((1,), i32), shape((1, 32), i32))
    blockers = []

    def forward(state, tokens, cache, batch):
        model = nnx.merge(graphdef, state)
        blockers.append((model.step_kernel_blocker(1, cache, 32), model.dense_attention_blocker()))
        return model.forward_paged(tokens, cache, batch)

    hlo = common.lower_for_h200(forward, state, shape((1,), i32), cache, batch)
    assert blockers == [(None, "dispatch.STEP_KERNEL_DENSE_ATTENTION is off" if knobs == "off" else None)]
    assert hlo.count("custom_call @mosaic_gpu") == (2 if knobs == "off" else 3)
    assert hlo.count("__gpu$xla.gpu.triton") == (7 if knobs == "off" else 1)
    assert hlo.count("stablehlo.rsqrt") == (2 if knobs == "off" else 0)
    assert "griddepcontrol" not in hlo
    if knobs != "built":
        assert "stablehlo.cosine" in hlo  # the kernels' cos / sin table (CSE'd by XLA), or the Triton launches' rope
        assert "stablehlo.gather" in hlo  # the token's embedding row, looked up before the kernels
    if knobs == "session 49":
        assert hlo.count("applies stablehlo.add") == 1  # the expert launch's partial rows summed after it
    if knobs == "built":
        # both attention kernels computing cos and sin themselves: no rope outside the kernels; the expert launch
        # adding into the attention kernel's f32 output in place: no sum, residual add or conversion between them
        assert "stablehlo.cosine" not in hlo and "stablehlo.sine" not in hlo
        assert "applies stablehlo.add" not in hlo and "tensor<1x2048xf32>) -> tensor<1x2048xbf16>" not in hlo
        assert "stablehlo.gather" not in hlo and "stablehlo.convert" not in hlo  # the row read by the kernel
        monkeypatch.setattr(dispatch, "STEP_KERNEL_PDL", True)  # the expert launch and the step kernel wait, PDL
        hlo = common.lower_for_h200(forward, state, shape((1,), i32), cache, batch)
        assert hlo.count("uses_pdl") == 2 and hlo.count("custom_call @mosaic_gpu") == 3
        # the rope's frequencies a whole constant (XLA keeps a broadcast of a constant: it would be a launch a step)
        assert not [line for line in hlo.splitlines()
                    if "= stablehlo.broadcast_in_dim" in line and line.endswith("-> tensor<32x32xf32>")]
