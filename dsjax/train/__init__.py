"""Tiny-model training: a DeepSeek-V3 model on the Python standard library, exported for dsjax and
transformers. ``python -m dsjax.train --help``."""

from dsjax.train.config import TrainConfig, load_train_config
from dsjax.train.forward import forward_with_routing, update_score_bias
from dsjax.train.pipeline import run
from dsjax.train.trainer import TrainState, train

__all__ = ["TrainConfig", "TrainState", "forward_with_routing", "load_train_config", "run", "train",
           "update_score_bias"]
