"""Training settings: a YAML file with a ``model:`` section (Hugging Face config.json keys) and a
``train:`` section (TrainConfig fields), e.g. configs/train/default-model.yaml."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from dsjax.config import ConfigError, ModelConfig

DTYPES = ("float32", "bfloat16")
DEFAULT_HELDOUT_MODULES = ("json", "csv", "textwrap", "fractions", "statistics")


def _refuse(field: str, value: Any, accepted: str) -> ConfigError:
    return ConfigError(f"train config field {field!r} = {value!r} is not supported; accepted: {accepted}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 64
    seq_len: int = 512
    learning_rate: float = 2e-3
    min_learning_rate: float = 2e-4  # the cosine decays to this
    warmup_steps: int = 100
    weight_decay: float = 0.1  # matrices only; norms, router bias and vectors are not decayed
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global norm
    # DeepSeek-V3's auxiliary-loss-free balancing: after each step, per MoE layer,
    # score_bias += bias_update_speed * sign(mean load - load of the expert).
    bias_update_speed: float = 1e-3
    dtype: str = "bfloat16"  # compute dtype; master weights and optimizer state stay float32
    export_dtype: str = "bfloat16"  # weights written to model.safetensors (the router stays float32)
    eval_every: int = 100
    eval_batches: int = 8  # held-out windows evaluated = eval_batches * batch_size (or all there are)
    checkpoint_every: int = 250
    log_every: int = 10
    seed: int = 0
    # Corpus: the stdlib of the running interpreter; these modules (file or package) are held out.
    heldout_modules: tuple[str, ...] = DEFAULT_HELDOUT_MODULES
    max_files: int | None = None  # training files kept (evenly spaced over the sorted list): quick runs
    sample_prompt: str = "def fibonacci(n):"
    sample_tokens: int = 64

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "checkpoint_every",
                     "log_every", "sample_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _refuse(name, value, "a positive integer")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise _refuse("warmup_steps", self.warmup_steps, "a non-negative integer")
        if not 0 < self.min_learning_rate <= self.learning_rate:
            raise _refuse("min_learning_rate", self.min_learning_rate,
                          f"a number in (0, learning_rate={self.learning_rate}]")
        for name in ("dtype", "export_dtype"):
            if getattr(self, name) not in DTYPES:
                raise _refuse(name, getattr(self, name), ", ".join(DTYPES))
        if self.max_files is not None and (not isinstance(self.max_files, int) or self.max_files < 1):
            raise _refuse("max_files", self.max_files, "null (every file) or a positive integer")
        if not self.heldout_modules:
            raise _refuse("heldout_modules", self.heldout_modules, "at least one stdlib module name")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["heldout_modules"] = list(self.heldout_modules)
        return out


def load_train_config(path: str | Path) -> tuple[ModelConfig, TrainConfig, dict[str, Any]]:
    """(model config, train config, the model section as written: it becomes config.json)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"train config {path} does not exist; see configs/train/*.yaml")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = set(data) - {"model", "train"}
    if unknown or "model" not in data:
        raise ConfigError(f"{path}: needs a 'model:' section and optionally 'train:'; got sections "
                          f"{sorted(data)}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    train = dict(data.get("train") or {})
    if set(train) - fields:
        raise ConfigError(f"{path}: unknown train keys {sorted(set(train) - fields)}; accepted: {sorted(fields)}")
    if "heldout_modules" in train:
        train["heldout_modules"] = tuple(train["heldout_modules"])
    model = ModelConfig.from_hf(data["model"])
    train_config = TrainConfig(**train)
    if train_config.seq_len > model.max_position_embeddings:
        raise _refuse("seq_len", train_config.seq_len,
                      f"at most max_position_embeddings={model.max_position_embeddings}")
    if model.bos_token_id is None or not model.eos_token_ids:
        raise ConfigError(f"{path}: the model section needs bos_token_id and eos_token_id (the tokenizer's "
                          "<|bos|> and <|eos|> ids)")
    return model, train_config, dict(data["model"])
