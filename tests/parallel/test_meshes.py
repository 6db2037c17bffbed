"""Meshes of simulated CPU devices give one device's logits and greedy tokens: TP=2, TP=2 x EP=4,
DP=2 x EP=4 on 8 devices (and the Pallas kernels per rank, in interpret mode), the expert all-to-all
on 4, and two processes of 2 devices over loopback.

JAX in this process already runs on one CPU device, so every check runs in a subprocess that sets
XLA_FLAGS first (worker.py); compiled programs land in the shared persistent cache.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

import dsjax
from dsjax import LLM
from tests.parallel.cases import ENGINE, GREEDY, PROMPTS, TOKENS

WORKER = Path(__file__).with_name("worker.py")
TIMEOUT_S = 400  # a cold compile cache on 2 busy cores


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}


def _result(proc_returncode: int, stdout: str, stderr: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc_returncode == 0 and lines, f"worker failed ({proc_returncode}):\n{stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def run_worker(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, env=_env(),
                          timeout=TIMEOUT_S)
    return _result(proc.returncode, proc.stdout, proc.stderr)


# EP=4 alone is in both of its products; TP=2 alone keeps the experts whole on each rank (no dispatch)
MESHES = {"tp2": (2, 1, 1), "tp2-ep4": (2, 4, 1), "dp2-ep4": (1, 4, 2)}


def test_meshes_match_one_device():
    """Every mesh in one worker: the one-device references (and their compiles) are made once."""
    results = run_worker("mesh", *(",".join(map(str, spec)) for spec in MESHES.values()))
    for name, (tp, ep, dp) in MESHES.items():
        r = results[f"{tp},{ep},{dp}"]
        assert r["logits_rel_err"] < 1e-4 and r["mesh_arg_logits_rel_err"] < 1e-4, name
        assert r["tokens_equal"], f"{name}: greedy tokens differ:\n{r['tokens']}\n{r['ref_tokens']}"
        assert r["logprob_err"] < 1e-3, name
        assert "num_scheduler_steps=2: multi-step decoding runs on one device" in r["multi_step_refusal"], name
        layers, experts, hidden, inter = r["expert_shape"]
        # weights live in shards
        assert r["expert_shard_shape"] == [layers, experts // ep, hidden, inter // tp], name
        if dp > 1:
            assert r["int8_tokens_equal"], name  # the 8-bit cache and its scales split like the latents
            # partial prefix hits copy blocks inside a rank's cache slice
            assert r["partial_prefix"] == {"tokens_equal": True, "partial_hits": 3, "blocks_used": 0}, name
        if tp > 1 and ep > 1:  # checkpoints load straight into the same shards
            for kind in ("hf", "orbax"):
                assert r[f"{kind}_logits_rel_err"] < 1e-4, (name, kind)
                assert r[f"{kind}_expert_shard_shape"] == r["expert_shard_shape"], (name, kind)
        # Each data-parallel rank's cache slice holds its share of max_num_seqs full-length sequences.
        seqs_per_rank = -(-ENGINE["max_num_seqs"] // (dp * ep))
        num_blocks = seqs_per_rank * -(-ENGINE["max_model_len"] // ENGINE["block_size"])
        assert r["cache_shard_shape"][1] == r["num_blocks_per_shard"] == num_blocks, name


def test_expert_all_to_all_matches_dense_experts():
    r = run_worker("dispatch")
    assert r["padded"] < 1e-5 and r["ragged_emulated"] < 1e-5 and r["allgather"] < 1e-5
    assert r["ragged_emulated_bf16"] < 2e-2 and r["allgather_bf16"] < 2e-2
    assert r["ragged_lowers"]  # the GPU transport traces, type-checks and lowers on CPU too
    assert r["capped_differs"]  # a capacity below the worst case drops rows (why tests run drop-free)


def test_kernels_per_rank_match_one_device():
    r = run_worker("kernels")
    for name in ("dp2-ep2-tp2", "tp2"):
        assert r[name]["tokens_equal"], f"{name}: greedy tokens differ:\n{r[name]['tokens']}\n{r['ref_tokens']}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one():
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), "host", str(i), "2", port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env()) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = [_result(p.returncode, *out) for p, out in zip(procs, outputs)]
    reference = [o.outputs[0].token_ids for o in LLM("tiny", **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)]
    logits = np.asarray(dsjax.load_model("tiny").logits(TOKENS))[:, -1, :8]
    for r in results:
        assert (r["process_count"], r["device_count"]) == (2, 4)
        assert r["tokens"] == reference
        np.testing.assert_allclose(r["logits"], logits, rtol=1e-4, atol=1e-5)
    assert results[0]["lockstep_tokens"] == reference[:-1]  # the served path: process 1 mirrored process 0
