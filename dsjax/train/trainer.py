"""The training loop: AdamW (linear warm-up, cosine decay, global-norm clipping) on next-token
cross-entropy, DeepSeek-V3's auxiliary-loss-free expert balancing, periodic held-out evaluation,
orbax checkpoints with resume, a JSONL log and a progress bar.

One jitted step samples its windows on the device from the state's rng, so a resumed run takes
exactly the steps an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from dsjax.config import ModelConfig
from dsjax.model.transformer import random_model
from dsjax.train.checkpoints import CheckpointStore
from dsjax.train.config import TrainConfig
from dsjax.train.data import TokenData, heldout_windows, sample_windows
from dsjax.train.forward import (cast_params, forward_with_routing, load_imbalance, next_token_loss,
                                 path_names, update_score_bias)

log = logging.getLogger(__name__)


class TrainState(NamedTuple):
    params: dict  # float32 master weights, the model's nnx state as a plain dict
    opt_state: Any
    step: jax.Array  # i32[]: steps taken
    rng: jax.Array  # u32[2]: the window-sampling key
    best_params: dict  # params at the lowest held-out loss so far (what gets exported)
    best_eval_loss: jax.Array  # f32[]: inf before the first evaluation
    best_step: jax.Array  # i32[]


@dataclasses.dataclass
class TrainResult:
    graphdef: Any
    state: TrainState
    history: list[dict]  # the log's records, resumed parts included
    steps_run: int  # in this process
    train_seconds: float  # this process's loop, compile included
    compile_seconds: float  # the first step of this process (compile + one step)
    tokens_per_second: float  # after the first step


def learning_rate_schedule(cfg: TrainConfig):
    return optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                              max(cfg.steps, cfg.warmup_steps + 1), cfg.min_learning_rate)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW on everything but the routers' score_bias, which only the balancing rule moves."""
    adamw = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(learning_rate_schedule(cfg), b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay,
                    mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if "score_bias" in path_names(path) else "adamw", params)
    return optax.multi_transform({"adamw": adamw, "frozen": optax.set_to_zero()}, labels)


def init_state(model_config: ModelConfig, cfg: TrainConfig):
    """(graphdef, TrainState, optimizer): random float32 weights (seed ``cfg.seed``) on the reference path."""
    model = random_model(model_config, dtype="float32", kernel_backend="reference", seed=cfg.seed)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    optimizer = make_optimizer(cfg)
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                       rng=jax.random.PRNGKey(cfg.seed), best_params=jax.tree.map(jnp.copy, params),
                       best_eval_loss=jnp.full((), jnp.inf, jnp.float32), best_step=jnp.zeros((), jnp.int32))
    return graphdef, state, optimizer


def make_train_step(graphdef, optimizer, cfg: TrainConfig):
    """jitted (state, train_tokens i32[N]) -> (state, metrics); the state is donated."""
    schedule = learning_rate_schedule(cfg)

    def step(state: TrainState, train_tokens):
        rng, sample_key = jax.random.split(state.rng)
        batch = sample_windows(train_tokens, sample_key, cfg.batch_size, cfg.seq_len + 1)  # [B, T+1]

        def loss_fn(params):
            model = nnx.merge(graphdef, cast_params(params, cfg.dtype))
            logits, counts = forward_with_routing(model, batch[:, :-1])
            return next_token_loss(logits, batch[:, 1:]), counts

        (loss, counts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params = update_score_bias(params, counts, cfg.bias_update_speed)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads), "lr": schedule(state.step),
                   "max_load": jnp.mean(load_imbalance(counts)) if counts.shape[0] else jnp.ones(())}
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1, rng=rng), metrics

    return jax.jit(step, donate_argnums=0)


def _global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(tree)))


def make_eval_step(graphdef, cfg: TrainConfig):
    """jitted (params, windows i32[b, T+1]) -> mean next-token loss over the b windows."""

    def eval_step(params, windows):
        model = nnx.merge(graphdef, cast_params(params, cfg.dtype))
        return next_token_loss(model(windows[:, :-1]), windows[:, 1:])

    return jax.jit(eval_step)


def evaluate(eval_step, params, windows: np.ndarray, batch_size: int) -> float:
    """Mean loss over held-out windows (batches of equal size, so the mean of batch means)."""
    size = min(batch_size, len(windows))
    losses = [eval_step(params, windows[i:i + size]) for i in range(0, len(windows), size)]
    return float(np.mean(jax.device_get(losses)))


class LossLog:
    """``log.jsonl``: one record per logged step ({"kind": "train"|"eval", "step", ...})."""

    def __init__(self, path: Path, keep_until_step: int):
        self.path = path
        records = []
        if keep_until_step and path.is_file():
            records = [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= keep_until_step]
        self.records = records
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    def append(self, record: dict) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def train(model_config: ModelConfig, cfg: TrainConfig, data: TokenData, work_dir: str | Path, *,
          resume: bool = False, progress: bool = True) -> TrainResult:
    work_dir = Path(work_dir)
    graphdef, state, optimizer = init_state(model_config, cfg)
    store = CheckpointStore(work_dir / "checkpoints", {"model": model_config.to_hf(), "data": data.directory.name,
                                                       "batch_size": cfg.batch_size, "seq_len": cfg.seq_len})
    if resume and store.latest_step() is not None:
        state = store.restore(state)
        log.info("resumed from %s at step %d", store.directory, int(state.step))
    else:
        if store.latest_step() is not None:
            log.info("starting over: clearing %s (pass --resume to continue it)", store.directory)
        store.clear()
    start_step = int(state.step)
    loss_log = LossLog(work_dir / "log.jsonl", keep_until_step=start_step)
    train_step, eval_step = make_train_step(graphdef, optimizer, cfg), make_eval_step(graphdef, cfg)
    train_tokens = jax.device_put(data.train_ids)
    if train_tokens.shape[0] <= cfg.seq_len + 1:
        raise ValueError(f"{train_tokens.shape[0]} training tokens cannot fill a window of seq_len="
                         f"{cfg.seq_len}; use more files or a shorter seq_len")
    windows = heldout_windows(data.heldout_ids, cfg.seq_len + 1, cfg.eval_batches * cfg.batch_size, cfg.batch_size)
    tokens_per_step = cfg.tokens_per_step

    bar = tqdm(total=cfg.steps, initial=start_step, disable=not progress, unit="step", dynamic_ncols=True,
               mininterval=2.0)
    began = interval_start = time.perf_counter()
    compile_seconds, steady_seconds, steady_steps = 0.0, 0.0, 0
    sums, interval_steps = None, 0
    for step in range(start_step + 1, cfg.steps + 1):
        state, metrics = train_step(state, train_tokens)
        sums = metrics if sums is None else jax.tree.map(jnp.add, sums, metrics)
        interval_steps += 1
        if step == start_step + 1:
            jax.block_until_ready(state.step)
            compile_seconds = time.perf_counter() - began
            sums, interval_steps, interval_start = None, 0, time.perf_counter()
            first = jax.device_get(metrics)
            loss_log.append(_train_record(step, first, 1, tokens_per_step, compile_seconds, began))
        elif step % cfg.log_every == 0 or step == cfg.steps:
            means = {k: float(v) / interval_steps for k, v in jax.device_get(sums).items()}
            seconds = time.perf_counter() - interval_start
            steady_seconds, steady_steps = steady_seconds + seconds, steady_steps + interval_steps
            record = _train_record(step, means, interval_steps, tokens_per_step, seconds, began)
            loss_log.append(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.3g}", refresh=False)
            sums, interval_steps, interval_start = None, 0, time.perf_counter()
        paused = time.perf_counter()  # evaluation and checkpoints are not training throughput
        if step % cfg.eval_every == 0 or step == cfg.steps:
            state = _evaluate_and_track_best(state, step, eval_step, windows, cfg, loss_log, began)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            store.save(step, state)
        interval_start += time.perf_counter() - paused
        bar.update(1)
    bar.close()
    store.close()
    train_seconds = time.perf_counter() - began
    tokens_per_second = steady_steps * tokens_per_step / steady_seconds if steady_seconds else 0.0
    return TrainResult(graphdef, state, loss_log.records, cfg.steps - start_step, train_seconds,
                       compile_seconds, tokens_per_second)


def _train_record(step, metrics, num_steps, tokens_per_step, seconds, began) -> dict:
    return {"kind": "train", "step": step, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
            "grad_norm": float(metrics["grad_norm"]), "max_load": float(metrics["max_load"]),
            "tokens": step * tokens_per_step, "tokens_per_s": num_steps * tokens_per_step / max(seconds, 1e-9),
            "elapsed_s": time.perf_counter() - began}


def _evaluate_and_track_best(state: TrainState, step: int, eval_step, windows, cfg: TrainConfig,
                             loss_log: LossLog, began: float) -> TrainState:
    loss = evaluate(eval_step, state.params, windows, cfg.batch_size)
    log.info("step %d: held-out loss %.4f (perplexity %.2f)", step, loss, math.exp(min(loss, 50.0)))
    loss_log.append({"kind": "eval", "step": step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)),
                     "eval_tokens": int(windows.shape[0] * (windows.shape[1] - 1)),
                     "elapsed_s": time.perf_counter() - began})
    if loss < float(state.best_eval_loss):
        # A copy: the params' buffers are donated to the next step.
        state = state._replace(best_params=jax.tree.map(jnp.copy, state.params),
                               best_eval_loss=jnp.asarray(loss, jnp.float32),
                               best_step=jnp.asarray(step, jnp.int32))
    return state
