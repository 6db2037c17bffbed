"""One tiny training run (configs/train/tiny.yaml on a few stdlib files) shared by the train tests,
and by the xdist workers: the first to get here runs it, the others wait and reuse it."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

try:
    from filelock import FileLock  # comes with the hf extra (transformers, torch)
except ImportError:  # each xdist worker then trains its own copy
    FileLock = None

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs" / "train" / "tiny.yaml"


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    from dsjax.train.__main__ import main

    base = tmp_path_factory.getbasetemp()
    shared = FileLock is not None and os.environ.get("PYTEST_XDIST_WORKER")
    root = (base.parent if shared else base) / "tiny_train_run"
    with FileLock(str(root) + ".lock") if shared else contextlib.nullcontext():
        if not (root / "summary.json").is_file():
            summary = main(["--config", str(TINY_CONFIG), "--out", str(root / "out"),
                            "--work-dir", str(root / "work"), "--no-progress"])
            (root / "summary.json").write_text(json.dumps(summary))
    return SimpleNamespace(out=root / "out", work=root / "work", config=TINY_CONFIG,
                           summary=json.loads((root / "summary.json").read_text()))
