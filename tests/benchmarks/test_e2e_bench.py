"""python -m dsjax.bench on CPU: every scenario through the real code on the tiny preset (one engine, a
small grid), the roofline model against issue #8's numbers, and the Hugging Face baseline's greedy tokens
against dsjax's on the same weights. Timings are only checked to be positive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import dsjax
from benchmarks.common import copy_bytes_per_s
from benchmarks.e2e_decode import explain, skip_reason
from benchmarks.e2e_summary import summary_markdown
from benchmarks.roofline import (H200_BYTES_PER_S, all_weight_bytes, batch_touching_fraction, decode_step_bytes,
                                 expected_experts_touched, kv_bytes_per_token)
from dsjax.bench.__main__ import main as bench_main

ROOT = Path(__file__).resolve().parents[2]
# A grid small enough for seconds on CPU: buckets (1, 2, 16), three compiles shared by every run here.
GRID = ["--batches", "1", "2", "--prompts", "8", "16", "--steps", "3", "--warmup-steps", "1", "--device-repeats", "2",
        "--prefill-chunk", "16", "--block-size", "8", "--requests", "8", "--scale", "0.03", "--max-tokens", "4",
        "--hf-batches", "1", "2", "--hf-prompt", "8", "--hf-new-tokens", "4", "--tag", "test"]
TINY = dsjax.load_config("tiny")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    written = bench_main(["all", *GRID, "--out-dir", str(out)])
    return out, written


def load(out: Path, scenario: str) -> dict:
    return json.loads((out / f"e2e_{scenario}_test.json").read_text())


# ----- the roofline model --------------------------------------------------------------------------

def test_experts_touched_formula():
    assert expected_experts_touched(0, 64, 6) == 0
    assert expected_experts_touched(1, 64, 6) == pytest.approx(6)
    touched = [expected_experts_touched(b, 64, 6) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert all(a < b < 64 for a, b in zip(touched, touched[1:]))
    assert expected_experts_touched(1000, 64, 6) == pytest.approx(64)
    b95 = batch_touching_fraction(0.95, 64, 6)
    assert expected_experts_touched(b95, 64, 6) >= 0.95 * 64 > expected_experts_touched(b95 - 1, 64, 6)
    with pytest.raises(ValueError, match="top_k"):
        expected_experts_touched(4, 8, 9)


def test_roofline_matches_issue_numbers():
    """Issue #8: 871 tok/s at batch 1, ~4.4k at batch 32, ~28k at batch 256 with 1k context (V2-Lite, 4.27 TB/s)."""
    config = dsjax.load_config("deepseek-v2-lite")
    # Every weight but the embedding table (one row per token is read) once all experts are touched.
    assert all_weight_bytes(config) == 2 * (config.num_params() - config.vocab_size * config.hidden_size)
    assert decode_step_bytes(config, 1, 128).tok_per_s() == pytest.approx(871, rel=0.01)
    assert decode_step_bytes(config, 32, 32 * 128).tok_per_s() == pytest.approx(4.4e3, rel=0.06)
    assert decode_step_bytes(config, 256, 256 * 1024).tok_per_s() == pytest.approx(28e3, rel=0.02)


def test_roofline_rises_with_batch_until_kv_dominates():
    config = dsjax.load_config("deepseek-v2-lite")
    context = 2048
    limit = H200_BYTES_PER_S / (context * kv_bytes_per_token(config))  # KV alone, per sequence
    curve = [decode_step_bytes(config, b, b * context).tok_per_s() for b in (1, 4, 16, 64, 256, 1024, 4096)]
    assert all(a < b < limit for a, b in zip(curve, curve[1:]))
    assert curve[-1] > 0.85 * limit
    step = decode_step_bytes(config, 4096, 4096 * context)
    assert step.kv_bytes > step.weight_bytes + step.expert_bytes


def test_skip_reason_names_what_does_not_fit():
    llm = SimpleNamespace(engine=SimpleNamespace(
        config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16),
        block_manager=SimpleNamespace(num_blocks_total=10)))
    assert skip_reason(llm, 2, 16, 4) is None
    assert "max_num_seqs=4" in skip_reason(llm, 8, 16, 4)
    assert "max_model_len=128" in skip_reason(llm, 1, 124, 4)
    assert "KV does not fit" in skip_reason(llm, 4, 60, 4)


@pytest.mark.parametrize("steps, says", [
    ((1.0, 1.2, 1.4), "the step stays within 1.5x of batch 1's 1.00 ms at every batch measured (1.40 ms at batch 4)"),
    ((1.0, 1.2, 2.0), "the step stays within 1.5x of batch 1's 1.00 ms up to batch 2, then reaches 2.00 ms"),
    ((1.0, 1.7, 2.0), "the step passes 1.5x of batch 1's 1.00 ms already at batch 2 (1.70 ms) and reaches 2.00 ms "
                      "at batch 4"),
])
def test_explain_says_where_the_step_grows(steps, says):
    rows = [{"batch": b, "prompt": 8, "step_ms": ms, "tok_per_s": b / ms * 1e3, "roofline_fraction": 0.5}
            for b, ms in zip((1, 2, 4), steps)]
    (line,) = [x for x in explain(TINY, rows, 4, H200_BYTES_PER_S) if x.startswith("Measured")]
    assert says in line


# ----- the scenarios on CPU ------------------------------------------------------------------------

def test_decode_curve(results):
    out, _ = results
    payload = load(out, "decode_curve")
    assert payload["preset"] == "tiny" and payload["scenario"] == "decode-curve"
    assert {(r["batch"], r["prompt"]) for r in payload["rows"]} | \
        {(s["batch"], s["prompt"]) for s in payload["skipped"]} == {(1, 8), (2, 8), (1, 16), (2, 16)}
    assert payload["rows"], payload["skipped"]
    for r in payload["rows"]:
        for key in ("step_ms", "tok_per_s", "device_step_ms", "device_tok_per_s", "roofline_tok_per_s",
                    "bytes_per_step", "roofline_step_ms"):
            assert r[key] > 0, key
        assert r["roofline_fraction"] == pytest.approx(r["tok_per_s"] / r["roofline_tok_per_s"])
        assert r["context"] >= r["prompt"] + 1  # prompt + tokens generated so far
        assert r["experts_touched"] == pytest.approx(
            expected_experts_touched(r["batch"], TINY.n_routed_experts, TINY.num_experts_per_tok))
        assert r["preemptions"] == 0
        assert r["step_p10_ms"] <= r["step_median_ms"] <= r["step_p90_ms"] and r["host_cpu_ms"] > 0
        assert r["tok_per_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3)  # tokens over elapsed time
    by_batch = {r["batch"]: r for r in payload["rows"] if r["prompt"] == 8}
    assert by_batch[1]["experts_touched"] == pytest.approx(TINY.num_experts_per_tok)
    assert by_batch[2]["roofline_tok_per_s"] > by_batch[1]["roofline_tok_per_s"]
    assert len(payload["analysis"]) == 2 + len({r["prompt"] for r in payload["rows"]})
    for kind in ("throughput", "latency"):
        assert (out / f"e2e_decode_curve_test_{kind}.png").stat().st_size > 1000


def test_mixed(results):
    out, _ = results
    payload = load(out, "mixed")
    rows = {r["workload"]: r for r in payload["rows"]}
    assert set(rows) == {"mixed", "templated"}
    for r in rows.values():
        assert r["requests"] == 8 and r["output_tokens"] == 8 * 4  # ignore_eos: exactly max_tokens each
        assert r["output_tok_per_s"] > 0 and r["ttft_p50_s"] > 0 and r["tpot_p50_ms"] > 0
        assert r["ttft_p99_s"] >= r["ttft_p50_s"] and r["tpot_p99_ms"] >= r["tpot_p50_ms"]
        assert 0 < r["batch_efficiency"] <= 1
    assert sum(payload["workload"]["requests_per_class"].values()) == 8
    # Random prompts share no block; templated ones share all but their own tail and the first sightings.
    assert rows["mixed"]["prefix_hit_rate"] < 0.1 < 0.3 < rows["templated"]["prefix_hit_rate"]
    # Hits can only be template tokens: the share of prompt tokens taken from templates bounds them.
    assert rows["templated"]["prefix_hit_rate"] <= rows["templated"]["template_share"] < 1
    assert payload["engine"]["num_compiled_shapes"] == 3 and payload["engine"]["warmup_s"] > 0
    assert (out / "e2e_mixed_test.png").stat().st_size > 1000


def test_hf_baseline_same_greedy_tokens(results):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out, _ = results
    payload = load(out, "hf_baseline")
    assert "same" in payload["hf"]["weights"]
    assert payload["greedy_check"]["match"], payload["greedy_check"]
    assert payload["greedy_check"]["rows"] == 3  # batch 1 + batch 2
    assert [r["batch"] for r in payload["rows"]] == [1, 2]
    assert all(r["hf_tok_per_s"] > 0 and r["dsjax_tok_per_s"] > 0 for r in payload["rows"])
    assert (out / "e2e_hf_baseline_test.png").stat().st_size > 1000


def test_summary_table(results):
    out, written = results
    summary = out / "e2e_summary_test.md"
    assert summary in written
    text = summary.read_text()
    for heading in ("## Decode", "## Hugging Face", "## Mixed workload", "Where the curve bends"):
        assert heading in text
    assert "| batch | prompt |" in text


def test_summary_marks_targets(results):
    out, _ = results
    decode = load(out, "decode_curve")
    decode["targets"] = [{"batch": 1, "prompt": 8, "tok_per_s": 1e-3}, {"batch": 2, "prompt": 8, "tok_per_s": 1e15},
                         {"batch": 64, "prompt": 8, "tok_per_s": 1.0}]

    def table_rows(text):
        return {line.split("|")[1].strip() + "/" + line.split("|")[2].strip(): line for line in text.splitlines()
                if line.startswith("| ") and line.split("|")[1].strip().isdigit()}

    text = summary_markdown({"decode-curve": {**decode, "device": "NVIDIA H200"}},
                            {"decode-curve": "e2e_decode_curve_test"})
    rows = table_rows(text)
    assert rows["1/8"].endswith("| yes |") and rows["2/8"].endswith("| miss |")
    assert "Target batch 64, prompt 8 (>= 1 tok/s): not measured (not in this grid)." in text
    assert "not judged" not in text
    # On another device the H200's targets stand beside their points, unjudged.
    text = summary_markdown({"decode-curve": {**decode, "device": "NVIDIA H100 80GB HBM3"}},
                            {"decode-curve": "e2e_decode_curve_test"})
    rows = table_rows(text)
    assert rows["2/8"].endswith("| >= 1,000,000,000,000,000 | (for an H200) |")
    assert "set for one H200: not judged on NVIDIA H100 80GB HBM3." in text


# ----- the entry point -----------------------------------------------------------------------------

def test_one_scenario_alone(tmp_path, capsys):
    """Same engine settings as the fixture's, so its compiled steps come from the compilation cache."""
    written = bench_main(["decode-curve", *GRID, "--prompts", "8", "--bandwidth", "2e12", "--out-dir", str(tmp_path)])
    assert sorted(p.name for p in written) == ["e2e_decode_curve_test.json", "e2e_decode_curve_test_latency.png",
                                               "e2e_decode_curve_test_throughput.png", "e2e_summary_test.md"]
    payload = json.loads((tmp_path / "e2e_decode_curve_test.json").read_text())
    assert [(r["batch"], r["prompt"]) for r in payload["rows"]] == [(1, 8), (2, 8)]
    assert payload["bandwidth"]["source"] == "given (--bandwidth)" and payload["roofline"]["bytes_per_s"] == 2e12
    for r in payload["rows"]:
        assert r["roofline_step_ms"] == pytest.approx(r["bytes_per_step"] / 2e12 * 1e3)
    summary = (tmp_path / "e2e_summary_test.md").read_text()
    assert "## Mixed" not in summary and "/ 2.00 TB/s, given (--bandwidth))" in summary
    assert "wrote" in capsys.readouterr().out


def test_roofline_bandwidth_on_cpu_is_the_h200_anchor(results):
    out, _ = results
    bandwidth = load(out, "decode_curve")["bandwidth"]
    assert bandwidth == {"measured_copy_bytes_per_s": None, "bytes_per_s": H200_BYTES_PER_S,
                         "source": "the H200 anchor (issue #8's measured copy rate)"}


def test_copy_bytes_per_s_is_a_rate():
    rate = copy_bytes_per_s(2**20, repeats=2)
    assert 1e6 < rate < 1e14  # bytes read + written a second, on whatever device runs the tests
    with pytest.raises(ValueError, match="size_bytes=2: accepted at least one 4-byte element"):
        copy_bytes_per_s(2)


def test_hf_baseline_batch_out_of_memory_is_skipped(tmp_path, monkeypatch):
    """A batch transformers cannot fit beside the engine is recorded with its reason; the others still run."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import benchmarks.hf_baseline as hf

    real = hf.hf_generate

    def squeezed(model, prompts, new_tokens, pad_token_id):
        if prompts.shape[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.06 GiB. GPU 0 has a total "
                                         "capacity of 79.18 GiB.\nsecond line")
        return real(model, prompts, new_tokens, pad_token_id)

    monkeypatch.setattr(hf, "hf_generate", squeezed)
    bench_main(["hf-baseline", *GRID, "--out-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "e2e_hf_baseline_test.json").read_text())
    assert [r["batch"] for r in payload["rows"]] == [1]
    (skip,) = payload["skipped_batches"]
    assert skip["batch"] == 2 and "(CUDA out of memory. Tried to allocate 2.06 GiB.)" in skip["reason"]
    assert "capacity" not in skip["reason"] and "second line" not in skip["reason"]
    assert payload["greedy_check"]["rows"] == 1 and payload["greedy_check"]["match"]
    assert "Batch 2 skipped: transformers ran out of device memory" in (tmp_path / "e2e_summary_test.md").read_text()


def test_decode_curve_in_multi_step_chunks(tmp_path):
    """--num-scheduler-steps 4: each timed engine step decodes a chunk of 4 tokens a sequence; the row's step is a
    decode step's share of it, and the context grows 4 tokens an engine step."""
    bench_main(["decode-curve", *GRID, "--prompts", "8", "--batches", "1", "--num-scheduler-steps", "4",
                "--out-dir", str(tmp_path)])
    (row,) = json.loads((tmp_path / "e2e_decode_curve_test.json").read_text())["rows"]
    assert row["num_scheduler_steps"] == 4 and row["tok_per_s"] == pytest.approx(1e3 / row["step_ms"])
    assert row["context"] >= 8 + 1 + 4 + 4  # prompt, first token, a warm-up chunk, then chunks of 4 (mean 17)


def test_bad_flags_name_the_field(capsys):
    with pytest.raises(SystemExit):
        bench_main(["decode-curve", "--batches", "0", "2"])
    assert "batches=(0, 2): accepted one or more integers >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["decode-curve", "--template-unique", "1.5"])
    assert "template_unique=1.5" in capsys.readouterr().err


def test_outside_the_checkout_says_where_to_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dsjax.bench", "decode-curve"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "run it from the repository root" in proc.stderr
