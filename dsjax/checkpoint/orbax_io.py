"""Converted weights saved and restored with orbax-checkpoint: a restore skips name mapping,
transposes, expert stacking and FP8 dequantization, and reads straight into the final layout."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from dsjax.checkpoint.safetensors_io import CheckpointError
from dsjax.config import ModelConfig
from dsjax.model.transformer import abstract_model, state_shardings
from dsjax.parallel.expert import ExpertDispatch

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
        checkpointer.save(directory / STATE_DIR, nnx.state(model, nnx.Param), force=True)
    return directory


def load_orbax(directory: str | Path, *, dtype: str | None = None, kernel_backend: str = "auto",
               mesh: Mesh | None = None, expert_dispatch: ExpertDispatch = ExpertDispatch()):
    directory = Path(directory).resolve()
    if not is_orbax_dir(directory):
        raise CheckpointError(f"{directory}: not a dsjax orbax checkpoint (needs {STATE_DIR}/ and {META_FILE})")
    config = ModelConfig.from_json(directory / "config.json")
    dtype = dtype or json.loads((directory / META_FILE).read_text())["dtype"]
    # Orbax casts on restore when the target dtype differs from the saved one, and reads each device's
    # shard straight into it when the target carries shardings.
    graphdef, abstract = nnx.split(abstract_model(config, dtype=dtype, kernel_backend=kernel_backend, mesh=mesh,
                                                  expert_dispatch=expert_dispatch))
    shardings = state_shardings(abstract, mesh)
    if shardings is not None:
        abstract = jax.tree.map(
            lambda sharding, v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)),
            shardings, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(directory / STATE_DIR, abstract)
    return nnx.merge(graphdef, state)
