"""Converted weights saved and restored with orbax-checkpoint: a restore skips name mapping,
transposes, expert stacking and FP8 dequantization, and reads straight into the final layout."""

from __future__ import annotations

import json
from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx

from dsjax.checkpoint.safetensors_io import CheckpointError
from dsjax.config import ModelConfig
from dsjax.model.transformer import abstract_model

STATE_DIR = "dsjax_state"
META_FILE = "dsjax.json"


def is_orbax_dir(directory: str | Path) -> bool:
    return (Path(directory) / STATE_DIR).is_dir() and (Path(directory) / META_FILE).is_file()


def save_orbax(model, directory: str | Path) -> Path:
    """Writes config.json (Hugging Face form), dsjax.json and the weights under ``directory``."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    (directory / META_FILE).write_text(json.dumps({"dtype": model.dtype.name}))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / STATE_DIR, nnx.state(model), force=True)
    return directory


def load_orbax(directory: str | Path, *, dtype: str | None = None, kernel_backend: str = "auto"):
    directory = Path(directory).resolve()
    if not is_orbax_dir(directory):
        raise CheckpointError(f"{directory}: not a dsjax orbax checkpoint (needs {STATE_DIR}/ and {META_FILE})")
    config = ModelConfig.from_json(directory / "config.json")
    dtype = dtype or json.loads((directory / META_FILE).read_text())["dtype"]
    # Orbax casts on restore when the target dtype differs from the saved one.
    graphdef, abstract = nnx.split(abstract_model(config, dtype=dtype, kernel_backend=kernel_backend))
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(directory / STATE_DIR, abstract)
    return nnx.merge(graphdef, state)
