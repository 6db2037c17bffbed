"""Corpus -> tokenizer -> token cache -> training -> Hugging Face export with a model card: the one
function behind ``python -m dsjax.train``."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import jax
import yaml
from flax import nnx

from dsjax.checkpoint import save_hf
from dsjax.config import ConfigError, ModelConfig
from dsjax.loader import load_model, load_tokenizer
from dsjax.train.bpe import BOS_ID, EOS_ID
from dsjax.train.config import TrainConfig, load_train_config
from dsjax.train.corpus import load_corpus
from dsjax.train.data import TokenData, copy_tokenizer, prepare_data
from dsjax.train.forward import cast_params
from dsjax.train.report import greedy_completion, model_card, plot_losses
from dsjax.train.trainer import TrainResult, train

log = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "train" / "default-model.yaml"


def active_params(config: ModelConfig) -> int:
    """Parameters a token passes through: all but the routed experts it is not sent to."""
    idle_experts = config.n_routed_experts - config.num_experts_per_tok
    return config.num_params() - config.num_moe_layers * idle_experts * 3 * config.hidden_size \
        * config.moe_intermediate_size


def run(config_path: str | Path = DEFAULT_CONFIG, *, out: str | Path, work_dir: str | Path, resume: bool = False,
        steps: int | None = None, batch_size: int | None = None, seq_len: int | None = None,
        dtype: str | None = None, max_files: int | None = None, progress: bool = True,
        command: str = "python -m dsjax.train") -> dict:
    """Trains the model of ``config_path`` and exports it to ``out``; returns the run summary."""
    began = time.perf_counter()
    model_config, cfg, model_section = load_train_config(config_path)
    cfg = cfg.replace(steps=steps, batch_size=batch_size, seq_len=seq_len, dtype=dtype, max_files=max_files)
    if cfg.seq_len > model_config.max_position_embeddings:
        raise ConfigError(f"seq_len={cfg.seq_len} exceeds max_position_embeddings="
                          f"{model_config.max_position_embeddings} of {config_path}")
    if model_config.bos_token_id != BOS_ID or model_config.eos_token_ids != (EOS_ID,):
        raise ConfigError(f"{config_path}: bos_token_id/eos_token_id must be {BOS_ID}/{EOS_ID}, the ids of "
                          f"<|bos|>/<|eos|> in the trained tokenizer; got {model_config.bos_token_id}/"
                          f"{list(model_config.eos_token_ids)}")
    work_dir = Path(work_dir)
    corpus = load_corpus(cfg.heldout_modules, cfg.max_files)
    log.info("corpus: %s", json.dumps(corpus.describe()))
    data = prepare_data(corpus, model_config.vocab_size, model_config.max_position_embeddings, work_dir)
    data_seconds = time.perf_counter() - began
    log.info("data: %d train / %d held-out tokens (%.2f bytes per token) in %s", data.train_ids.size,
             data.heldout_ids.size, data.info["bytes_per_token"], data.directory)
    log.info("model: %.3gM parameters (%.3gM active); %d steps of %d x %d tokens = %.3gM tokens (%.2g epochs)",
             model_config.num_params() / 1e6, active_params(model_config) / 1e6, cfg.steps, cfg.batch_size,
             cfg.seq_len, cfg.steps * cfg.tokens_per_step / 1e6,
             cfg.steps * cfg.tokens_per_step / max(data.train_ids.size, 1))
    result = train(model_config, cfg, data, work_dir, resume=resume, progress=progress)
    log.info("trained %d steps in %.0f s (first step, compile included, %.0f s): %.0f tokens/s", result.steps_run,
             result.train_seconds, result.compile_seconds, result.tokens_per_second)
    summary = export(result, model_config, model_section, cfg, data, out, work_dir,
                     data_seconds=data_seconds, began=began, command=command)
    log.info("exported %s: held-out loss %.3f (step %d), %.0f s in all", out, summary["best_eval_loss"],
             summary["best_step"], summary["total_seconds"])
    return summary


def export(result: TrainResult, model_config: ModelConfig, model_section: dict, cfg: TrainConfig,
           data: TokenData, out: str | Path, work_dir: str | Path, *, data_seconds: float, began: float,
           command: str) -> dict:
    """config.json + model.safetensors (the best held-out params), tokenizer files, train_config.yaml,
    train_log.jsonl, loss.png, train_summary.json and README.md into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = result.state
    model = nnx.merge(result.graphdef, cast_params(state.best_params, cfg.export_dtype))
    save_hf(model, out)
    copy_tokenizer(data, out)
    (out / "train_config.yaml").write_text(yaml.safe_dump({"model": model_section, "train": cfg.to_dict()},
                                                           sort_keys=False))
    shutil.copy2(Path(work_dir) / "log.jsonl", out / "train_log.jsonl")
    num_params = sum(leaf.size for leaf in jax.tree.leaves(state.params))
    name = out.resolve().name
    loss_png = plot_losses(result.history, out / "loss.png",
                           f"{name}: {num_params / 1e6:.1f}M params, {cfg.steps} steps")
    exported = load_model(out, dtype="float32", kernel_backend="reference", progress=False)
    sample = greedy_completion(exported, load_tokenizer(out), cfg.sample_prompt, cfg.sample_tokens)
    last_train = [r for r in result.history if r["kind"] == "train"][-1]
    device = jax.devices()[0]
    summary = {
        "name": name, "command": command, "model": model_config.to_hf(), "train": cfg.to_dict(),
        "data": data.info, "num_params": int(num_params), "active_params": active_params(model_config),
        "safetensors_bytes": (out / "model.safetensors").stat().st_size, "steps": cfg.steps,
        "tokens_seen": cfg.steps * cfg.tokens_per_step, "best_eval_loss": float(state.best_eval_loss),
        "best_step": int(state.best_step), "final_train_loss": last_train["loss"],
        "final_max_load": last_train["max_load"], "tokens_per_second": result.tokens_per_second,
        "data_seconds": data_seconds, "train_seconds": result.train_seconds,
        "compile_seconds": result.compile_seconds, "steps_run": result.steps_run,
        "device": f"{device.platform}: {device.device_kind}", "sample": sample,
        "loss_png": loss_png is not None,
    }
    summary["total_seconds"] = time.perf_counter() - began
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    (out / "README.md").write_text(model_card(summary))
    return summary
