"""The GPU benchmark scripts stay runnable: their --quick mode runs tiny shapes in interpret mode."""

from __future__ import annotations

from benchmarks import kernels_attention, kernels_moe


def test_attention_benchmark_quick(capsys):
    kernels_attention.main(["--quick"])
    assert "mla_decode" in capsys.readouterr().out


def test_moe_benchmark_quick(capsys):
    kernels_moe.main(["--quick"])
    assert "grouped_swiglu" in capsys.readouterr().out
