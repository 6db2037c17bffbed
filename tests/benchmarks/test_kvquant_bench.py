"""benchmarks/kvquant.py runs for real on CPU (small settings) and records what the issue asks for."""

from __future__ import annotations

import json

import jax
import pytest

from benchmarks import kvquant


def test_kvquant_cpu_run_records_capacity_and_accuracy(tmp_path):
    out = tmp_path / "kvquant"
    kvquant.main(["--windows", "1", "--gen-tokens", "8", "--prompts", "1", "--capacity-requests", "24",
                  "--kinds", "auto", "int8", "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    v2 = {r["kv_cache_dtype"]: r for r in result["capacity"]["deepseek-v2-lite"]}
    assert v2["fp8/128"]["bytes_per_token_per_layer"] == 656 and 1.7 < v2["int8"]["capacity_x"] < 1.8
    measured = {r["kv_cache_dtype"]: r for r in result["capacity_measured"]["rows"]}
    assert measured["int8"]["num_blocks"] > 2 * measured["auto"]["num_blocks"]  # f32 model: 4x smaller latent
    assert measured["int8"]["max_running"] > measured["auto"]["max_running"]
    rows = {r["kv_cache_dtype"]: r for r in result["accuracy_default"]["rows"]}
    assert set(rows) == {"auto", "int8", "int8 + window 128"}
    assert 1.3 < v2["int8 + window 512"]["capacity_x"] < v2["int8"]["capacity_x"]
    assert abs(rows["int8"]["perplexity_change_pct"]) < 5 and rows["int8"]["top1_agreement"] > 0.9
    assert "v2lite_logit_error" not in result  # GPU parts only with --gpu-parts on a GPU


def test_gpu_only_parts_refuse_cleanly_on_cpu(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("the GPU parts run here")
    for flag in ("--decode-sweep", "--kernels-only"):
        with pytest.raises(SystemExit):
            kvquant.main([flag])
        assert "they need a GPU" in capsys.readouterr().err
