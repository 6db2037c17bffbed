"""Runs in a subprocess with simulated CPU devices (XLA_FLAGS is set before JAX starts): the pytest
process has already started JAX with one device. Prints one JSON line of results on stdout.

    python tests/parallel/worker.py mesh TP,EP,DP ...   # meshes against one device
    python tests/parallel/worker.py dispatch            # expert all-to-all against the dense reference
    python tests/parallel/worker.py kernels             # the Pallas kernels (interpret) per rank
    python tests/parallel/worker.py host PROCESS_ID NUM_PROCESSES PORT   # one process of a multi-host run
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODE = sys.argv[1]
NUM_DEVICES = {"mesh": 8, "dispatch": 4, "kernels": 8, "host": 2}[MODE]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NUM_DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", str(REPO / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

import dsjax  # noqa: E402
from dsjax import LLM, ParallelConfig  # noqa: E402
from dsjax.config import ConfigError  # noqa: E402
from tests.parallel.cases import ENGINE, GREEDY, PROMPTS, TOKENS  # noqa: E402


def generate(**parallel):
    llm = LLM("tiny", **{**ENGINE, **parallel})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs]


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def check_meshes(specs: list[tuple[int, int, int]]) -> dict:
    """Each (TP, EP, DP) mesh against one device; the one-device references are computed once."""
    import functools

    one_device = dsjax.load_model("tiny")
    reference = np.asarray(one_device.logits(TOKENS))
    ref_llm, ref_tokens, ref_logprobs = generate()
    int8_reference = functools.cache(lambda: generate(kv_cache_dtype="int8")[1])
    return {f"{tp},{ep},{dp}": check_mesh(tp, ep, dp, one_device, reference, ref_llm, ref_tokens, ref_logprobs,
                                          int8_reference) for tp, ep, dp in specs}


def partial_prefix_hits(llm, ref_llm) -> dict:
    """A 13-token template over 8-token blocks, then prompts that share it, one at a time (each lands
    in the pool that caches it): the second block is reused in part through a copy inside that rank's
    cache slice. Tokens must equal the one-device engine's for the same calls."""
    template = list(range(200, 213))
    calls = [template + [7, 8, 9, 10, 11, 12, 13, 14]] + [template + [20 + i, 30 + i] for i in range(3)]

    def run(engine_llm):
        engine_llm.engine.block_manager.reset_prefix_cache()
        before = engine_llm.engine.block_manager.num_partial_hits
        tokens = [engine_llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in calls]
        return tokens, engine_llm.engine.block_manager.num_partial_hits - before

    tokens, hits = run(llm)
    ref_tokens, _ = run(ref_llm)
    return {"tokens_equal": tokens == ref_tokens, "partial_hits": hits,
            "blocks_used": llm.engine.block_manager.num_blocks_used}


def check_mesh(tp, ep, dp, one_device, reference, ref_llm, ref_tokens, ref_logprobs, int8_reference) -> dict:
    parallel = ParallelConfig(tensor_parallel_size=tp, expert_parallel_size=ep, data_parallel_size=dp)
    model = dsjax.load_model("tiny", parallel=parallel)
    experts = model.moe_layers.mlp.w_gate[...]
    llm, tokens, logprobs = generate(parallel=parallel)
    checkpoints = {}
    if tp > 1 and ep > 1:  # every relayout kind, heads and experts split: HF and orbax straight into shards
        import tempfile

        from dsjax.checkpoint import save_hf, save_orbax

        with tempfile.TemporaryDirectory() as tmp:
            save_hf(one_device, Path(tmp) / "hf")
            save_orbax(model, Path(tmp) / "orbax")
            for kind in ("hf", "orbax"):
                loaded = dsjax.load_model(Path(tmp) / kind, parallel=parallel, progress=False)
                checkpoints[f"{kind}_logits_rel_err"] = rel_err(loaded.logits(TOKENS), reference)
                checkpoints[f"{kind}_expert_shard_shape"] = list(
                    loaded.moe_layers.mlp.w_gate[...].addressable_shards[0].data.shape)
    if dp > 1:  # an 8-bit cache (latents + scales) split over data-parallel ranks
        _, int8_tokens, _ = generate(kv_cache_dtype="int8", parallel=parallel)
        checkpoints["int8_tokens_equal"] = int8_tokens == int8_reference()
        checkpoints["partial_prefix"] = partial_prefix_hits(llm, ref_llm)
    on_mesh = dsjax.load_model("tiny", mesh=model.mesh)  # a ready mesh instead of a ParallelConfig
    try:  # multi-step chunks run on one device: refused on a mesh, before any compile
        LLM("tiny", **{**ENGINE, "num_scheduler_steps": 2}, parallel=parallel)
        checkpoints["multi_step_refusal"] = None
    except ConfigError as e:
        checkpoints["multi_step_refusal"] = str(e)
    return {
        **checkpoints,
        "logits_rel_err": rel_err(model.logits(TOKENS), reference),
        "mesh_arg_logits_rel_err": rel_err(on_mesh.logits(TOKENS), reference),
        "expert_shard_shape": list(experts.addressable_shards[0].data.shape), "expert_shape": list(experts.shape),
        "cache_shard_shape": list(llm.engine.runner.cache.c_kv.addressable_shards[0].data.shape),
        "tokens_equal": tokens == ref_tokens, "tokens": tokens, "ref_tokens": ref_tokens,
        "logprob_err": max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)),
        "num_blocks_per_shard": llm.engine.runner.num_blocks_per_shard,
    }


def check_dispatch() -> dict:
    """moe_expert_parallel (all-gather, padded, and ragged with an emulated transport) on 4 expert ranks
    against the dense reference over all tokens; also lowers the real ragged_all_to_all (GPU-only to run)."""
    from jax.sharding import PartitionSpec as P

    from dsjax.parallel import expert as ep_module
    from dsjax.parallel.expert import ExpertDispatch, moe_expert_parallel
    from pallas_kernels.moe_experts import moe_experts_reference

    ranks, experts, top_k, tokens, hidden, inter = 4, 8, 3, 24, 16, 32
    rng = np.random.default_rng(1)
    skewed = np.exp(-1.5 * np.arange(experts))  # most assignments go to rank 0: the worst case
    ids = np.stack([rng.choice(experts, top_k, replace=False, p=skewed / skewed.sum()) for _ in range(tokens)])
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    weights = rng.uniform(0.1, 1, (tokens, top_k)).astype(np.float32)
    shapes = [(experts, hidden, inter), (experts, hidden, inter), (experts, inter, hidden)]
    args = (x, weights, ids.astype(np.int32), *(0.2 * rng.standard_normal(s).astype(np.float32) for s in shapes))
    reference = np.asarray(moe_experts_reference(*args))
    mesh = jax.make_mesh((ranks,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))

    def run(dispatch):
        def local(x, w, i, wg, wu, wd):
            fn = lambda rows, rw, ri: moe_experts_reference(rows, rw, ri, wg, wu, wd)
            return moe_expert_parallel(x, w, i, wg.shape[0], fn, dispatch)
        body = jax.shard_map(local, mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"))
        return jax.jit(body)

    results = {"padded": rel_err(run(ExpertDispatch(transport="padded"))(*args), reference),
               "allgather": rel_err(run(ExpertDispatch(transport="allgather"))(*args), reference)}
    lowered = run(ExpertDispatch(transport="ragged")).lower(*args).as_text()
    results["ragged_lowers"] = "ragged_all_to_all" in lowered or "ragged-all-to-all" in lowered
    ep_module.ragged_all_to_all = _emulated_ragged_all_to_all
    results["ragged_emulated"] = rel_err(run(ExpertDispatch(transport="ragged"))(*args), reference)
    capped = run(ExpertDispatch(capacity_factor=1.0, transport="padded"))(*args)  # drops rows: must differ
    results["capped_differs"] = rel_err(capped, reference) > 1e-3
    # bf16 rows: weights and ids travel bit-packed in two 16-bit columns each
    as_bf16 = (jnp.asarray(x, jnp.bfloat16), *args[1:])
    results["ragged_emulated_bf16"] = rel_err(run(ExpertDispatch(transport="ragged"))(*as_bf16), reference)
    results["allgather_bf16"] = rel_err(run(ExpertDispatch(transport="allgather"))(*as_bf16), reference)
    return results


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
    """lax.ragged_all_to_all's documented semantics from all_gathers (XLA:CPU has no ragged op)."""
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [src, N, ...]
    src_in, src_size, src_out = (jax.lax.all_gather(a, axis_name)[:, me] for a in
                                 (input_offsets, send_sizes, output_offsets))  # what each source sends me
    rows = jnp.arange(output.shape[0])
    for src in range(ops.shape[0]):
        hit = (rows >= src_out[src]) & (rows < src_out[src] + src_size[src])
        taken = ops[src][jnp.clip(src_in[src] + rows - src_out[src], 0, ops.shape[1] - 1)]
        output = jnp.where(hit.reshape(-1, *[1] * (output.ndim - 1)), taken, output)
    del recv_sizes
    return output


def check_kernels() -> dict:
    """The GPU code path on CPU: Pallas kernels in interpret mode on each rank's shards (local heads,
    local experts, the other ranks' slots as empty expert rows) and the transport the GPU takes at EP=2
    (auto: the all-gather, ep <= k), DP=2 x EP=2 x TP=2; and TP=2 alone."""
    _, ref_tokens, _ = generate()
    result = {"ref_tokens": ref_tokens}
    # DP=2 x EP=2 x TP=2; and TP=2 alone on two prompts with buckets of 2 tokens, whose decode steps take
    # the one-launch MoE path (local experts, its norm finished in the routing kernel, the residual
    # joining after the ranks' sum)
    runs = (("dp2-ep2-tp2", ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2, data_parallel_size=2),
             PROMPTS, {}),
            ("tp2", ParallelConfig(tensor_parallel_size=2), PROMPTS[:2], {"buckets": (2, 32)}))
    for name, parallel, prompts, engine in runs:
        llm = LLM("tiny", kernel_backend="interpret", parallel=parallel, **(ENGINE | engine))
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        result[name] = {"tokens_equal": tokens == ref_tokens[:len(prompts)], "tokens": tokens}
    return result


def run_host(process_id: int, num_processes: int, port: int) -> dict:
    """One process of a 2-process run: TP=2 within a process, EP=2 across them (the all-to-all and
    the KV cache slices span processes)."""
    parallel = ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2, coordinator_address=f"127.0.0.1:{port}",
                              num_processes=num_processes, process_id=process_id)
    from jax.experimental import multihost_utils

    from dsjax.serve.multihost import LockstepEngine, follow

    llm, tokens, _ = generate(parallel=parallel)
    logits = multihost_utils.process_allgather(llm.model.logits(TOKENS), tiled=True)
    # The server's arrangement: process 0 takes the requests and steps, process 1 mirrors it.
    lockstep_tokens = None
    if process_id == 0:
        engine = LockstepEngine(llm.engine)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"served-{i}", None, GREEDY, prompt_token_ids=prompt)
        engine.abort_request("served-5")
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        engine.shutdown()
        lockstep_tokens = [done[f"served-{i}"] for i in range(len(PROMPTS) - 1)]
    else:
        follow(llm.engine)
    return {"process_count": jax.process_count(), "device_count": jax.device_count(), "tokens": tokens,
            "logits": np.asarray(logits)[:, -1, :8].tolist(), "lockstep_tokens": lockstep_tokens}


if __name__ == "__main__":
    if MODE == "mesh":
        result = check_meshes([tuple(map(int, spec.split(","))) for spec in sys.argv[2:]])
    elif MODE == "dispatch":
        result = check_dispatch()
    elif MODE == "kernels":
        result = check_kernels()
    else:
        result = run_host(*map(int, sys.argv[2:5]))
    print("RESULT " + json.dumps(result), flush=True)
