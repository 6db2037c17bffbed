"""The batch-1 step kernel's expert phase and MoE half (pallas_kernels/decode_step_moe.py): they lower for an
abstract H200 with each expert plan, say what they do not take, the plans cover every box once, and the jnp
references are the chains they claim. Numerics on the GPU in tests/gpu."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_step_moe as kernel
from pallas_kernels.common import lower_for_h200, rms_norm


def _moe_shapes(layers: int, experts: int = 64):
    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    routed = (shape((layers, experts, 2048, 1408), bf16), shape((layers, experts, 2048, 1408), bf16),
              shape((layers, experts, 1408, 2048), bf16))
    shared = (shape((layers, 2048, 2816), bf16), shape((layers, 2048, 2816), bf16), shape((layers, 2816, 2048), bf16))
    return (shape((2048,), bf16), shape((layers, 6), jnp.float32), shape((layers, 6), jnp.int32), *routed, shared)


def test_moe_chain_lowers_for_hopper_and_says_what_it_takes(monkeypatch):
    """The step kernel's expert phase (V2-Lite's layer, top-6 of 64 and 2 shared experts, a few layers) lowers
    with each plan (h fetched, summed or its own, built into its tile in one place); moe_supports names what it
    does not take."""
    for plan in kernel.PLANS:
        monkeypatch.setattr(kernel, "EXPERT_PLAN", plan)
        hlo = lower_for_h200(kernel.moe_chain, *_moe_shapes(3))
        assert hlo.count("custom_call @mosaic_gpu") == 1
    monkeypatch.setattr(kernel, "EXPERT_PLAN", "greedy")
    with pytest.raises(ValueError, match="EXPERT_PLAN='greedy'; accepted: tiles, dealt, split"):
        jax.eval_shape(kernel.moe_chain, *_moe_shapes(1))
    x, weights, ids, *rest = _moe_shapes(3)
    with pytest.raises(ValueError, match=r"expected weights and ids \[L=3, k\]"):
        jax.eval_shape(kernel.moe_chain, x, weights, jax.ShapeDtypeStruct((2, 6), jnp.int32), *rest)
    monkeypatch.setattr(kernel, "why_not_hopper", lambda: None)
    assert kernel.moe_supports(2048, 1408, 2816, 26, jnp.bfloat16) is None
    assert "hidden size 2000 is not a multiple of 512" in kernel.moe_supports(2000, 1408, 2816, 26, jnp.bfloat16)
    assert "moe intermediate size 1400" in kernel.moe_supports(2048, 1400, 2816, 26, jnp.bfloat16)
    assert "float32" in kernel.moe_supports(2048, 1408, 2816, 26, jnp.float32)
    assert "shared memory" in kernel.moe_supports(8192, 2048, 2048, 26, jnp.bfloat16)
    assert "0 layers" in kernel.moe_supports(2048, 1408, 2816, 0, jnp.bfloat16)


def test_moe_chain_reference_adds_each_layer_to_its_input():
    """The reference chain: x_{l+1} = x_l + layer l's experts of x_l, rounded each layer (tiny shapes, CPU)."""
    from pallas_kernels.moe_decode import moe_decode_reference

    rng = np.random.default_rng(1)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / 4, jnp.bfloat16)
    x = w(16)
    weights = jnp.asarray(rng.random((2, 2)), jnp.float32)
    ids = jnp.asarray([[0, 3], [2, 4]], jnp.int32)  # 4: an empty slot of 4 experts
    routed, shared = (w(2, 4, 16, 8), w(2, 4, 16, 8), w(2, 4, 8, 16)), (w(2, 16, 8), w(2, 16, 8), w(2, 8, 16))
    want = x
    for layer in range(2):
        step = moe_decode_reference(want[None], weights[layer][None], ids[layer][None], *routed, layer, shared)[0]
        want = (want.astype(jnp.float32) + step.astype(jnp.float32)).astype(jnp.bfloat16)
    got = kernel.moe_chain_reference(x, weights, ids, *routed, shared)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["tiles", "dealt", "split"])
def test_expert_plan_covers_every_box_once(kind):
    """Every gate / up box of V2-Lite's 176 tiles is one CTA's and its 16 down boxes are covered once; dealt
    or split, each of 132 CTAs streams 64 boxes and a CTA's own tile's down follows its gate / up; split, the
    first 132 tiles stay whole and the 44 others are cut into 3 K ranges, each CTA's range first."""
    plan = kernel.expert_plan(176, 132, 16, 16, kind, shared_from=132)
    assert plan.shape[2] == 5
    gate_up, down = np.zeros((176, 32), int), np.zeros((176, 16), int)
    loads = []
    for units in plan:
        load = 0
        for kind_, tile, first, end, part in units:
            if kind_ == kernel.GATE_UP:
                gate_up[tile, first:end] += 1
                load += end - first
            elif kind_ == kernel.DOWN:
                down[tile, first:end] += 1
                load += end - first
            else:
                assert (kind_, tile, first, end, part) == (-1,) * 5
        loads.append(load)
    assert (gate_up == 1).all() and (down == 1).all()
    assert kernel._fetches_h(plan, 32) == (kind == "dealt")  # whole tiles: every h stays in its CTA
    if kind == "dealt":
        assert set(loads) == {64}
        singles = plan[44:]  # CTAs with one tile: its gate / up, its down, halves of two others' downs
        assert (singles[:, 0, :2] == np.stack([np.zeros(88, int), np.arange(44, 132)], 1)).all()
        assert (singles[:, 1, :2] == singles[:, 0, 1:2] * [0, 1] + [kernel.DOWN, 0]).all()
    elif kind == "split":
        assert set(loads) == {64} and kernel.split_parts(176, 132) == 3
        first = plan[:, 0]  # a K range of tile 132 + c // 3 first: 6, 5, 5 K steps (12, 10, 10 boxes)
        assert (first[:, 1] == 132 + np.arange(132) // 3).all() and (first[:, 4] == np.arange(132) % 3).all()
        assert [tuple(r[2:4]) for r in first[:3]] == [(0, 12), (12, 22), (22, 32)]
        assert (plan[:, 1, 1] == np.arange(132)).all()  # then its own tile, whole
        assert (plan[:, 2, :2] == [[kernel.DOWN, c] for c in range(132)]).all()
        assert [tuple(r[2:4]) for r in plan[:3, 3]] == [(0, 4), (4, 10), (10, 16)]  # its down rows, last
    else:
        assert sorted(loads) == [48] * 88 + [96] * 44
    assert kernel.expert_plan(100, 132, 16, 16, kind).shape == (132, 2, 5)  # fewer tiles than CTAs: whole
    assert kernel.split_parts(100, 132) == 0 and kernel.split_parts(240, 132) == 0  # none, or one range a tile
    with pytest.raises(ValueError, match="expert plan 'greedy'; accepted: tiles, dealt, split"):
        kernel.expert_plan(176, 132, 16, 16, "greedy")


def test_moe_block_chain_lowers_for_hopper_and_says_what_it_takes(monkeypatch):
    """The MoE half of a layer in the step kernel (RMSNorm, the router's products on 16 CTAs, routing in every
    CTA, the experts) lowers with either plan at V2-Lite's shapes; moe_supports names what the router takes."""
    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    x, _, _, *routed, shared = _moe_shapes(2)
    norm, router = shape((2, 2048), bf16), shape((2, 2048, 64), jnp.float32)
    call = lambda x, norm, router, *experts: kernel.moe_block_chain(
        x, norm, router, kernel.RouterSpec(1e-6), 6, *experts[:3], experts[3:])
    for plan, router_dtype in (("tiles", jnp.float32), ("dealt", jnp.float32), ("dealt", bf16), ("split", bf16)):
        monkeypatch.setattr(kernel, "EXPERT_PLAN", plan)  # f32 router weights: two bf16 parts, two boxes
        hlo = lower_for_h200(lambda *a: call(*a), x, norm, shape(router.shape, router_dtype), *routed, *shared)
        assert hlo.count("custom_call @mosaic_gpu") == 1
    # its bf16 parts, prepared once (router_parts): the same kernel
    parts = jax.eval_shape(kernel.router_parts, router)
    assert parts.shape == (2, 2, 2048, 64) and parts.dtype == bf16
    assert lower_for_h200(call, x, norm, parts, *routed, *shared).count("custom_call @mosaic_gpu") == 1
    with pytest.raises(ValueError, match=r"router float16\[2, 2048, 64\]; accepted: \[L, D, E\] in bfloat16 or"):
        jax.eval_shape(call, x, norm, shape(router.shape, jnp.float16), *routed, *shared)
    with pytest.raises(ValueError, match="32 experts; the in-kernel router takes 64"):
        jax.eval_shape(call, x, norm, shape((2, 2048, 32), jnp.float32), *routed, *shared)
    for bad in (shape((3, 2048, 64), jnp.float32), shape((2, 3, 2048, 64), bf16), shape((2, 2, 2048, 64), jnp.float32)):
        with pytest.raises(ValueError, match=r"accepted: the router \[L, D, E\] in bfloat16 or float32, or its "):
            jax.eval_shape(call, x, norm, bad, *routed, *shared)
    monkeypatch.setattr(kernel, "why_not_hopper", lambda: None)
    assert kernel.moe_supports(2048, 1408, 2816, 26, bf16, router=True, num_experts=64, top_k=6) is None
    assert "160 routed experts" in kernel.moe_supports(2048, 1408, 2816, 26, bf16, router=True, num_experts=160,
                                                       top_k=6)
    assert "top-9 routing" in kernel.moe_supports(2048, 1408, 2816, 26, bf16, router=True, num_experts=64, top_k=9)
    # a router CTA a 128-row K step: 32 of them, but only 2 expert tiles (so 2 CTAs)
    assert "needs 32 router CTAs" in kernel.moe_supports(4096, 64, 64, 1, bf16, router=True, num_experts=64, top_k=1)


def test_moe_block_chain_reference_routes_each_layer_from_its_normed_input():
    """The reference: each layer's routing from its own normed input, its output the next layer's input."""
    from pallas_kernels.common import rms_norm
    from pallas_kernels.moe_routing import RoutingSpec, route_reference

    rng = np.random.default_rng(2)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / 4, jnp.bfloat16)
    x, norm = w(16), jnp.asarray(1 + rng.random((2, 16)) / 4, jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((2, 16, 4)), jnp.float32)
    routed, shared = (w(2, 4, 16, 8), w(2, 4, 16, 8), w(2, 4, 8, 16)), (w(2, 16, 8), w(2, 16, 8), w(2, 8, 16))
    spec = kernel.RouterSpec(1e-6, norm_topk_prob=True, routed_scaling_factor=2.0)
    out, ids, weights = kernel.moe_block_chain_reference(x, norm, router, spec, 2, *routed, shared)
    assert out.shape == (16,) and ids.shape == weights.shape == (2, 2)
    parts = kernel.router_parts(router)  # two bf16 parts whose sum is the router to ~2^-17
    np.testing.assert_allclose(parts.astype(jnp.float32).sum(axis=1), router, rtol=2e-5)
    from_parts = kernel.moe_block_chain_reference(x, norm, parts, spec, 2, *routed, shared)
    assert (from_parts[1] == ids).all()
    np.testing.assert_allclose(np.asarray(from_parts[2]), np.asarray(weights), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 2.0, rtol=1e-5)  # normed to 1, scaled by 2
    logits = rms_norm(x[None], norm[0], 1e-6).astype(jnp.float32) @ router[0]
    assert (route_reference(logits, None, RoutingSpec(top_k=2, norm_topk_prob=True))[1][0] == ids[0]).all()


def test_moe_layer_tail_chain_lowers_for_hopper_and_says_what_it_takes(monkeypatch):
    """The layer from its attention output on (o_proj, a barrier, the MoE half) lowers at V2-Lite's shapes with
    the dealt and split plans; moe_supports names what the o_proj phase does not take."""
    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    x, _, _, *routed, shared = _moe_shapes(2)
    attn, o_proj = shape((2, 2048), bf16), shape((2, 2048, 2048), bf16)
    norm, router = shape((2, 2048), bf16), shape((2, 2048, 64), jnp.float32)
    call = lambda x, attn, o_proj, norm, router, *experts: kernel.moe_layer_tail_chain(
        x, attn, o_proj, norm, router, kernel.RouterSpec(1e-6), 6, *experts[:3], experts[3:])
    for plan in ("dealt", "split"):
        monkeypatch.setattr(kernel, "EXPERT_PLAN", plan)
        hlo = lower_for_h200(call, x, attn, o_proj, norm, router, *routed, *shared)
        assert hlo.count("custom_call @mosaic_gpu") == 1
    with pytest.raises(ValueError, match=r"expected \[L=2, A\] and \[L, A, D=2048\]"):
        jax.eval_shape(call, x, attn, shape((2, 2048, 1024), bf16), norm, router, *routed, *shared)
    monkeypatch.setattr(kernel, "why_not_hopper", lambda: None)
    supports = lambda attention, router=True: kernel.moe_supports(2048, 1408, 2816, 26, bf16, router=router,
                                                                  num_experts=64, top_k=6, attention=attention)
    assert supports(2048) is None  # 32 column tiles x 4 K ranges: 128 of the 132 CTAs
    assert "attention width 2000 is not a multiple of 512" in supports(2000)
    assert "needs 160 CTAs" in supports(2560)
    assert "comes with the router" in supports(2048, router=False)


def test_moe_layer_tail_chain_reference_adds_o_proj_before_the_moe_half():
    """The reference: x_mid = bf16(x + attn @ o_proj) feeds the MoE half (tiny shapes, CPU)."""
    rng = np.random.default_rng(3)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / 4, jnp.bfloat16)
    x, attn, o_proj = w(16), w(2, 8), w(2, 8, 16)
    norm = jnp.asarray(1 + rng.random((2, 16)) / 4, jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((2, 16, 4)), jnp.float32)
    routed, shared = (w(2, 4, 16, 8), w(2, 4, 16, 8), w(2, 4, 8, 16)), (w(2, 16, 8), w(2, 16, 8), w(2, 8, 16))
    spec = kernel.RouterSpec(1e-6)
    out, ids, weights = kernel.moe_layer_tail_chain_reference(x, attn, o_proj, norm, router, spec, 2, *routed, shared)
    want = x
    for layer in range(2):
        want = (want.astype(jnp.float32) + attn[layer].astype(jnp.float32) @ o_proj[layer].astype(jnp.float32)).astype(
            jnp.bfloat16)
        one = lambda a: a[layer:layer + 1]
        want, want_ids, _ = kernel.moe_block_chain_reference(want, one(norm), one(router), spec, 2, one(routed[0]),
                                                             one(routed[1]), one(routed[2]), tuple(map(one, shared)))
        assert (ids[layer] == want_ids[0]).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("query_tma", [False, True])
def test_moe_layer_chain_lowers_for_hopper(monkeypatch, query_tma):
    """Whole V2-Lite layers at one token (the attention phases, o_proj, the MoE half) lower as one kernel for an
    abstract H200, with the attention's buffers in the MoE half's shared memory; also with phase 3's query
    windows read by TMA (``decode_step_attention.QUERY_TMA``)."""
    from pallas_kernels import decode_step_attention

    monkeypatch.setattr(decode_step_attention, "QUERY_TMA", query_tma)
    from pallas_kernels.decode_step_attention import AttentionSpec, AttentionWeights

    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    layers, hidden, heads = 2, 2048, 16
    x, _, _, *routed, shared = _moe_shapes(layers)
    attention = AttentionWeights(shape((layers, hidden), bf16), shape((layers, hidden, heads, 192), bf16),
                                 shape((layers, hidden, 576), bf16), shape((layers, 512), bf16),
                                 shape((layers, 512, heads, 128), bf16), shape((layers, 512, heads, 128), bf16),
                                 shape((layers, heads, 128, hidden), bf16))
    spec = AttentionSpec(1e-6, 1e-6, 0.07, tuple([1.0] * 32), 1.0)
    norm, router = shape((layers, hidden), bf16), shape((layers, hidden, 64), jnp.float32)

    def call(x, position, table, c_kv, k_pe, norm, router, *rest):
        return kernel.moe_layer_chain(x, position, table, c_kv, k_pe, AttentionWeights(*rest[:7]), spec, norm, router,
                                      kernel.RouterSpec(1e-6), 6, *rest[7:10], rest[10:])

    caches = shape((layers, 16, 64, 512), bf16), shape((layers, 16, 64, 64), bf16)
    operands = (x, shape((), jnp.int32), shape((8,), jnp.int32), *caches, norm, router, *attention, *routed, *shared)
    assert lower_for_h200(call, *operands).count("custom_call @mosaic_gpu") == 1
    assert kernel._moe_smem_bytes(hidden, True, 3, heads) <= 227 * 1024
    if query_tma:  # with the model's final norm after the last layer (CTA 0): x_L comes back normed, as bf16 [D]
        final = lambda *a: kernel.moe_layer_chain(*a[:5], AttentionWeights(*a[7:14]), spec, a[5], a[6],
                                                  kernel.RouterSpec(1e-6), 6, *a[14:17], a[17:20],
                                                  final_norm=(a[20], 1e-6))
        hlo = lower_for_h200(final, *operands, shape((hidden,), jnp.float32))
        assert hlo.count("custom_call @mosaic_gpu") == 1
        assert jax.eval_shape(final, *operands, shape((hidden,), jnp.float32))[0] == shape((hidden,), bf16)
        with pytest.raises(ValueError, match=r"final_norm weights \(2000,\) .* not \[D=2048\]"):
            jax.eval_shape(final, *operands, shape((2000,), jnp.float32))


def _ops(module: str, op: str) -> int:
    """How many ``op`` operations a lowered module's text holds."""
    return len(re.findall(rf"\b{re.escape(op)}\b", module))


@functools.cache
def _built_whole() -> str:
    """The whole layers' kernel as built, lowered once a test process (a probe test calls it before it sets its
    probe): ~7 s a lowering on the CPU."""
    from benchmarks.code_lines import kernel_call, lowered_modules

    fn, args = kernel_call("whole")
    return lowered_modules(fn, *args)[0]


def test_probe_fixed_routing_keeps_the_picks_work(monkeypatch):
    """``decode_step_moe.PROBE_FIXED_ROUTING`` (a diagnostic, timing only; decode_profile.md round 41) takes
    experts 0 .. k - 1 but keeps the picks' work: their compares stay in the whole layers' module, each pick
    feeding a select, and the products are as built."""
    from benchmarks.code_lines import kernel_call, lowered_modules

    built = _built_whole()
    fn, args = kernel_call("whole")
    monkeypatch.setattr(kernel, "PROBE_FIXED_ROUTING", True)
    fixed = lowered_modules(fn, *args)[0]
    assert _ops(fixed, "arith.cmpi") > _ops(built, "arith.cmpi")
    assert _ops(fixed, "arith.select") > _ops(built, "arith.select")
    assert _ops(fixed, "wgmma") == _ops(built, "wgmma")


def test_probe_phase_cut_leaves_out_the_named_phases_work(monkeypatch):
    """``decode_step_attention.PROBE_PHASE_CUT`` (a diagnostic, timing only): the named attention phases' CTAs
    leave out their work but still await and free their boxes. Phase 1 loses its products, phase 2 its products
    and the rope CTA's copies ("wuk": the W_UK units' products and stores; "rope": the rope and latent CTAs'
    copies); phase 3 from a point on: its states' stores, then its value products, then its scores too; the
    merge loses its loads of the chunks' states, phase 4 its products and loads; an unknown name is refused. Counted
    in the attention chain's module: the whole layers' phases (``attention_phases``) in ~60% of the text."""
    from benchmarks.code_lines import kernel_call, lowered_modules
    from pallas_kernels import decode_step_attention

    fn, args = kernel_call("attention")
    built = lowered_modules(fn, *args)[0]
    cuts = {}
    for name in decode_step_attention.PHASE_CUTS:
        monkeypatch.setattr(decode_step_attention, "PROBE_PHASE_CUT", (name,))
        cuts[name] = lowered_modules(fn, *args)[0]
    for name in ("phase1", "phase2", "wuk", "phase4"):
        assert _ops(cuts[name], "wgmma") < _ops(built, "wgmma"), name
    assert _ops(cuts["wuk"], "wgmma") == _ops(cuts["phase2"], "wgmma")
    assert _ops(cuts["rope"], "wgmma") == _ops(built, "wgmma")
    for name in ("phase2", "wuk", "rope"):
        assert _ops(cuts[name], "cp.async.bulk") < _ops(built, "cp.async.bulk"), name
    assert _ops(cuts["chunk_states"], "llvm.store") < _ops(built, "llvm.store")
    assert _ops(cuts["chunk_states"], "wgmma") == _ops(built, "wgmma")
    assert _ops(cuts["chunk_values"], "wgmma") < _ops(cuts["chunk_states"], "wgmma")
    assert _ops(cuts["chunk"], "wgmma") < _ops(cuts["chunk_values"], "wgmma")
    assert _ops(cuts["merge"], "wgmma") == _ops(built, "wgmma")
    for name in ("merge", "phase4"):
        assert _ops(cuts[name], "llvm.load") < _ops(built, "llvm.load"), name
    monkeypatch.setattr(decode_step_attention, "PROBE_PHASE_CUT", ("phase3", "phase1"))
    with pytest.raises(ValueError, match=r"PROBE_PHASE_CUT names 'phase3'; accepted: phase1, phase2, wuk, rope, "
                                         r"chunk_states, chunk_values, chunk, merge, phase4"):
        lowered_modules(fn, *args)


def test_probe_no_wait_leaves_out_the_named_barriers_waits(monkeypatch):
    """``decode_step_mgpu.PROBE_NO_WAIT`` (a benchmark's diagnostic): every CTA still arrives at a named grid barrier
    but no longer waits there, so the whole layers' kernel has one semaphore wait (an acquire fence) fewer a named
    barrier, and a name the kernel does not have is refused, in the call or in the setting."""
    from benchmarks.code_lines import kernel_call, lowered_modules
    from pallas_kernels import decode_step_mgpu

    fn, args = kernel_call("whole")
    count = lambda module: len(re.findall(r'"fence\.acquire\.gpu;"', module))
    waits = lambda: count(lowered_modules(fn, *args)[0])
    built = count(_built_whole())
    monkeypatch.setattr(decode_step_mgpu, "PROBE_NO_WAIT", ("phase2",))
    assert waits() == built - 1
    monkeypatch.setattr(decode_step_mgpu, "PROBE_NO_WAIT", decode_step_mgpu.BARRIER_NAMES)
    assert waits() == built - len(decode_step_mgpu.BARRIER_NAMES)
    with pytest.raises(ValueError, match=r"grid barrier name 'phase9' .*; accepted: phase1, phase2, .*, layer"):
        decode_step_mgpu._arrive_and_wait(None, 132, 1, "phase9")
    monkeypatch.setattr(decode_step_mgpu, "PROBE_NO_WAIT", ("phase2", "phase5"))  # a typo fails, not times as built
    with pytest.raises(ValueError, match=r"grid barrier name 'phase5' \(the barrier's, in PROBE_NO_WAIT or in "):
        waits()


def test_probe_relaxed_at_sends_the_named_barriers_arrivals_relaxed(monkeypatch):
    """``decode_step_mgpu.PROBE_RELAXED_AT`` (a benchmark's diagnostic): the named grid barriers' arrivals are relaxed
    adds, with no release, so the whole layers' kernel has one release add fewer and one relaxed add more a named
    barrier; a name the kernel does not have is refused."""
    from benchmarks.code_lines import kernel_call, lowered_modules
    from pallas_kernels import decode_step_mgpu

    fn, args = kernel_call("whole")
    count = lambda module, kind: len(re.findall(rf"red\.{kind}\.gpu\.global\.add", module))
    built = _built_whole()
    monkeypatch.setattr(decode_step_mgpu, "PROBE_RELAXED_AT", ("phase2", "phase3"))
    module = lowered_modules(fn, *args)[0]
    assert count(module, "release") == count(built, "release") - 2
    assert count(module, "relaxed") == count(built, "relaxed") + 2
    monkeypatch.setattr(decode_step_mgpu, "PROBE_RELAXED_AT", ("phase6",))
    with pytest.raises(ValueError, match=r"grid barrier name 'phase6' \(the barrier's, in PROBE_NO_WAIT or in "
                                         r"PROBE_RELAXED_AT\)"):
        lowered_modules(fn, *args)


def test_probe_code_pad_adds_the_producers_padding_once_a_layer(monkeypatch):
    """``PROBE_CODE_PAD`` (a benchmark's diagnostic): the producer's layer loop gains one inline PTX block of that
    many multiply-adds, run by its last warps only, straight-line or, looped, a sixteenth of them in a loop that
    ptxas is told not to unroll; a count the 8 chains and 16 turns cannot share is refused."""
    from benchmarks.code_lines import kernel_call, lowered_modules

    fn, args = kernel_call("whole")
    mads = lambda module: len(re.findall(r"mad\.lo\.u32 a\d, a\d, m, \d+;", module))
    assert mads(_built_whole()) == 0
    monkeypatch.setattr(kernel, "PROBE_CODE_PAD", 256)
    module = lowered_modules(fn, *args)[0]
    assert mads(module) == 256 and module.count("pad_skip:") == 1 and "setp.lt.u32 p, t, 96;" in module
    monkeypatch.setattr(kernel, "PROBE_CODE_PAD_LOOPED", True)
    monkeypatch.setattr(kernel, "PROBE_CODE_PAD_WARPS", 3)
    module = lowered_modules(fn, *args)[0]
    assert mads(module) == 16 and 'pad_loop:\\0A.pragma \\22nounroll\\22;' in module
    assert "setp.lt.u32 p, t, 32;" in module
    monkeypatch.setattr(kernel, "PROBE_CODE_PAD", 100)
    with pytest.raises(ValueError, match="PROBE_CODE_PAD 100; accepted: a multiple of 128"):
        lowered_modules(fn, *args)


def test_compact_smem_makes_room_for_a_tenth_ring_slot(monkeypatch):
    """``COMPACT_SMEM`` (on as built): the whole layers' kernel shares one buffer between its two norms' weights
    (so the first layer fetches only its attention norm's before the first barrier: one TMA load fewer than with
    a buffer each) and packs its small buffers, so that V2-Lite's whole layers lower with a ring of 10 boxes in
    the 227 KiB a block may have, which the separate buffers cannot; the attention chain alone fits such a ring
    as it is."""
    from benchmarks.code_lines import kernel_call, lowered_modules
    from pallas_kernels import decode_step_attention, decode_step_mgpu

    fn, args = kernel_call("whole")
    loads = lambda module: module.count("nvvm.cp.async.bulk.tensor.shared.cluster.global")
    built = _built_whole()
    monkeypatch.setattr(kernel, "COMPACT_SMEM", False)
    assert loads(lowered_modules(fn, *args)[0]) == loads(built) + 1
    for module in (kernel, decode_step_mgpu, decode_step_attention):
        monkeypatch.setattr(module, "RING", 10)
    too_big = r"exceeds available shared memory: smem_bytes=244960 > max_smem_bytes=232448"
    with pytest.raises(ValueError, match=too_big):
        lowered_modules(fn, *args)
    monkeypatch.setattr(kernel, "COMPACT_SMEM", True)
    assert loads(lowered_modules(fn, *args)[0]) == loads(built)
    attention, attention_args = kernel_call("attention")
    lowered_modules(attention, *attention_args)


def test_moe_layer_chain_reference_is_the_attention_then_the_moe_half():
    """The whole layers' reference: each layer's attention half, then its MoE half (tiny shapes, CPU)."""
    from pallas_kernels.decode_step_attention import AttentionSpec, AttentionWeights, attention_half_reference

    rng = np.random.default_rng(6)
    layers, hidden, heads = 2, 64, 2
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.bfloat16)
    attention = AttentionWeights(jnp.ones((layers, hidden), jnp.bfloat16), w(layers, hidden, heads, 192),
                                 w(layers, hidden, 576), jnp.ones((layers, 512), jnp.bfloat16),
                                 w(layers, 512, heads, 128), w(layers, 512, heads, 128), w(layers, heads, 128, hidden))
    spec = AttentionSpec(1e-6, 1e-6, 192 ** -0.5, tuple(10000.0 ** (-np.arange(0, 64, 2) / 64)), 1.0)
    c_kv = jnp.asarray(rng.standard_normal((layers, 2, 64, 512)), jnp.bfloat16)
    k_pe = jnp.asarray(rng.standard_normal((layers, 2, 64, 64)), jnp.bfloat16)
    norm = jnp.ones((layers, hidden), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((layers, hidden, 4)), jnp.float32)
    routed = (w(layers, 4, hidden, 8), w(layers, 4, hidden, 8), w(layers, 4, 8, hidden))
    shared = (w(layers, hidden, 8), w(layers, hidden, 8), w(layers, 8, hidden))
    x, table, moe_spec = jnp.asarray(rng.standard_normal(hidden), jnp.bfloat16), jnp.asarray([1, 0], jnp.int32), \
        kernel.RouterSpec(1e-6)
    out, ids, _, kv = kernel.moe_layer_chain_reference(x, 5, table, c_kv, k_pe, attention, spec, norm, router,
                                                       moe_spec, 2, *routed, shared)
    want = x
    for layer in range(layers):
        one = lambda a: a[layer:layer + 1]
        want, c_l, k_l = attention_half_reference(want, 5, table, c_kv[layer], k_pe[layer],
                                                  AttentionWeights(*(a[layer] for a in attention)), spec)
        np.testing.assert_array_equal(np.asarray(kv[layer]), np.asarray(jnp.concatenate([c_l[1, 5], k_l[1, 5]])))
        want, want_ids, _ = kernel.moe_block_chain_reference(want, one(norm), one(router), moe_spec, 2, *map(one, routed),
                                                             tuple(map(one, shared)))
        np.testing.assert_array_equal(np.asarray(ids[layer]), np.asarray(want_ids[0]))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    g = jnp.asarray(1 + rng.random(hidden) / 4, jnp.bfloat16)  # the model's final norm after the last layer
    normed, *_ = kernel.moe_layer_chain_reference(x, 5, table, c_kv, k_pe, attention, spec, norm, router, moe_spec, 2,
                                                  *routed, shared, final_norm=(g.astype(jnp.float32), 1e-6))
    np.testing.assert_array_equal(np.asarray(normed, np.float32), np.asarray(rms_norm(want, g, 1e-6), np.float32))


@pytest.mark.parametrize("top_k", [1, 6, 8])
def test_rank_picks_are_lax_top_k_ties_to_the_lower_id(top_k):
    """The producer's top-k by rank (``_rank_picks``), run on jnp arrays: lax.top_k's ids in its order, ties
    to the lower id included, with the warpgroup's -inf padding past the experts."""
    rng = np.random.default_rng(top_k)
    for trial in range(20):
        values = rng.standard_normal(64).astype(np.float32)
        if trial % 2:  # few distinct values: many ties, some among the picks
            values = np.round(values * 2) / 2
        logits = jnp.asarray(np.concatenate([values, np.full(64, -np.inf, np.float32)]))
        picks = kernel._rank_picks(logits, jnp.arange(128, dtype=jnp.int32), logits, 64, top_k)
        assert [int(p) for p in picks] == jax.lax.top_k(jnp.asarray(values), top_k)[1].tolist()
    with pytest.raises(ValueError, match="96 experts; accepted a multiple of 8 up to 64"):
        kernel._rank_picks(logits, jnp.arange(128, dtype=jnp.int32), logits, 96, 6)
