"""The tiny run end to end: the loss falls, a resumed run repeats the uninterrupted one, the output
directory holds what the model card promises."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np

from dsjax.train.config import load_train_config
from dsjax.train.corpus import load_corpus
from dsjax.train.data import prepare_data
from dsjax.train.trainer import train


def _records(history, kind):
    return [r for r in history if r["kind"] == kind]


def test_loss_falls(tiny_run):
    history = [json.loads(line) for line in (tiny_run.out / "train_log.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in _records(history, "train")]
    vocab = tiny_run.summary["data"]["vocab_size"]
    assert abs(train_losses[0] - math.log(vocab)) < 0.5  # a fresh model is near uniform
    assert np.mean(train_losses[-5:]) < train_losses[0] - 0.8
    evals = [r["eval_loss"] for r in _records(history, "eval")]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert tiny_run.summary["best_eval_loss"] == min(evals)


def test_resume_repeats_the_uninterrupted_run(tiny_run, tmp_path):
    """Back to the step-20 checkpoint: steps 21..40 give the same losses as the first time."""
    work = tmp_path / "work"
    shutil.copytree(tiny_run.work, work)
    shutil.rmtree(work / "checkpoints" / "40")
    model_config, cfg, _ = load_train_config(tiny_run.config)
    data = prepare_data(load_corpus(cfg.heldout_modules, cfg.max_files), model_config.vocab_size,
                        model_config.max_position_embeddings, work)
    assert data.directory.parent == work  # the cached tokens, not a retrained tokenizer
    result = train(model_config, cfg, data, work, resume=True, progress=False)
    assert result.steps_run == 20 and int(result.state.step) == 40
    first = {r["step"]: r["loss"] for r in _records(_history(tiny_run.work), "train")}
    resumed = {r["step"]: r["loss"] for r in _records(result.history, "train")}
    assert sorted(resumed) == list(range(1, 41))  # the log kept steps 1..20 and continued
    np.testing.assert_allclose([resumed[s] for s in range(21, 41)], [first[s] for s in range(21, 41)],
                               rtol=1e-6)
    evals = _records(result.history, "eval")
    assert [r["step"] for r in evals] == [20, 40]
    np.testing.assert_allclose(evals[1]["eval_loss"], _records(_history(tiny_run.work), "eval")[1]["eval_loss"],
                               rtol=1e-6)


def _history(work):
    return [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]


def test_export_directory(tiny_run):
    out, summary = tiny_run.out, tiny_run.summary
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
                 "train_config.yaml", "train_log.jsonl", "train_summary.json", "loss.png"):
        assert (out / name).is_file(), name
    card = (out / "README.md").read_text()
    assert "held-out loss" in card and f"{summary['best_eval_loss']:.3f}" in card
    assert summary["sample"].startswith("def fibonacci(n):") and summary["sample"] in card
    assert summary["data"]["train_files"] == 6 and "json" in summary["data"]["heldout_modules"]
    assert summary["tokens_per_second"] > 0 and summary["steps_run"] == 40
