"""``load_model`` and ``load_tokenizer``: a Hugging Face directory, a dsjax orbax directory or a preset name."""

from __future__ import annotations

from pathlib import Path

from jax.sharding import Mesh

from dsjax.checkpoint.hf import load_hf_checkpoint
from dsjax.checkpoint.orbax_io import is_orbax_dir, load_orbax
from dsjax.config import ConfigError, ModelConfig, ParallelConfig, list_presets
from dsjax.model.transformer import random_model
from dsjax.parallel.expert import expert_dispatch
from dsjax.parallel.mesh import check_mesh, make_mesh, parallel_config_of, prepare_process
from dsjax.tokenizer import ByteTokenizer, HFTokenizer

DTYPES = ("float32", "bfloat16")
# Models that ship in the repository, by name (trained by dsjax.train; see each folder's README.md).
EMBEDDED_MODELS = {"default": Path(__file__).resolve().parents[1] / "models" / "default"}
DEFAULT_MODEL = "default"


def _resolve(path_or_preset: str | Path) -> tuple[str, Path | str]:
    path = Path(path_or_preset).expanduser()
    if not path.is_dir() and str(path_or_preset) in EMBEDDED_MODELS:
        path = EMBEDDED_MODELS[str(path_or_preset)]
        if not (path / "config.json").is_file():
            raise ConfigError(f"the embedded model {str(path_or_preset)!r} is missing from {path}: dsjax finds it "
                              "in the checkout it is installed from (pip install -e .)")
    if path.is_dir():
        if is_orbax_dir(path):
            return "orbax", path
        if (path / "config.json").is_file():
            return "hf", path
        raise ConfigError(f"model directory {path} holds neither config.json nor a dsjax orbax checkpoint")
    if str(path_or_preset) in list_presets():
        return "preset", str(path_or_preset)
    raise ConfigError(f"model {str(path_or_preset)!r} is neither a directory, an embedded model nor a preset; "
                      f"embedded: {', '.join(EMBEDDED_MODELS)}; presets: {', '.join(list_presets())}")


def load_model(path_or_preset: str | Path, dtype: str = "float32", kernel_backend: str = "auto", *,
               seed: int = 0, progress: bool = True, parallel: ParallelConfig | None = None,
               mesh: Mesh | None = None):
    """A DeepSeek-V2/V3 model: weights from a checkpoint, or deterministic random ones for a preset.

    ``parallel`` (or a ready ``mesh`` with axes data, expert, tensor) spreads it over devices: every
    weight is placed straight into its shards (docs/parallelism.md).
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
    kind, where = _resolve(path_or_preset)
    parallel = parallel or ParallelConfig()
    prepare_process(parallel)
    if mesh is None:
        mesh = make_mesh(parallel)
    else:
        parallel = parallel_config_of(check_mesh(mesh), parallel)
    placement = dict(mesh=mesh, expert_dispatch=expert_dispatch(parallel))
    if kind == "orbax":
        return load_orbax(where, dtype=dtype, kernel_backend=kernel_backend, **placement)
    if kind == "hf":
        return load_hf_checkpoint(where, dtype=dtype, kernel_backend=kernel_backend, progress=progress, **placement)
    return random_model(ModelConfig.preset(where), dtype=dtype, kernel_backend=kernel_backend, seed=seed, **placement)


def load_config(path_or_preset: str | Path) -> ModelConfig:
    kind, where = _resolve(path_or_preset)
    return ModelConfig.preset(where) if kind == "preset" else ModelConfig.from_json(Path(where) / "config.json")


def load_tokenizer(path_or_preset: str | Path):
    config = load_config(path_or_preset)
    kind, where = _resolve(path_or_preset)
    if kind != "preset" and (Path(where) / "tokenizer.json").is_file():
        return HFTokenizer(where, config.bos_token_id, config.eos_token_ids)
    return ByteTokenizer(config.vocab_size, config.bos_token_id, config.eos_token_ids)
