"""The training forward and DeepSeek-V3's auxiliary-loss-free balancing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.model import random_model
from dsjax.train.config import load_train_config
from dsjax.train.forward import forward_with_routing, load_imbalance, update_score_bias
from dsjax.train.pipeline import DEFAULT_CONFIG

# The tests' training config (1 dense + 1 MoE layer of 8 experts): small programs, quick compiles.
CONFIG = load_train_config(DEFAULT_CONFIG.with_name("tiny.yaml"))[0]


def _tokens(batch, length, vocab, seed=0):
    return np.random.default_rng(seed).integers(3, vocab, size=(batch, length), dtype=np.int32)


def test_training_forward_is_the_model_forward():
    model = random_model(CONFIG, kernel_backend="reference")
    tokens = _tokens(2, 16, model.config.vocab_size)
    logits, counts = jax.jit(forward_with_routing)(model, tokens)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(model.logits(tokens)))
    config = model.config
    assert counts.shape == (config.num_moe_layers, config.n_routed_experts)
    np.testing.assert_array_equal(np.asarray(counts).sum(-1), 2 * 16 * config.num_experts_per_tok)


def test_bias_rises_for_idle_experts_and_falls_for_busy_ones():
    params = {"moe_layers": {"mlp": {"score_bias": jnp.zeros((2, 4))}}, "embed": jnp.ones((3, 2))}
    counts = jnp.asarray([[10, 2, 2, 2], [4, 4, 4, 4]])  # layer 0: mean 4; layer 1: balanced
    out = update_score_bias(params, counts, 0.5)
    np.testing.assert_array_equal(out["moe_layers"]["mlp"]["score_bias"], [[-0.5, 0.5, 0.5, 0.5], [0, 0, 0, 0]])
    assert out["embed"] is params["embed"]


def test_bias_updates_move_load_toward_balance():
    """A lopsided router (every token's hidden state shares a direction c that the router scores
    higher for low expert ids) is evened out by the bias updates alone, as in training: the counts
    of a step set the bias, the bias steers the next step's routing."""
    config = CONFIG
    model = random_model(config, kernel_backend="reference", seed=1)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    c = jax.random.normal(jax.random.key(0), (config.hidden_size,))
    c = c / jnp.linalg.norm(c)
    params["embed"] = params["embed"] + 0.15 * c
    preference = jnp.linspace(1.0, -1.0, config.n_routed_experts)  # expert 0 likes c most
    mlp = params["moe_layers"]["mlp"]
    params["moe_layers"]["mlp"] = {**mlp, "router": mlp["router"] + 0.05 * c[:, None] * preference}
    tokens = _tokens(4, 32, config.vocab_size, seed=3)

    @jax.jit
    def step(params):
        _, counts = forward_with_routing(nnx.merge(graphdef, params), tokens)
        return update_score_bias(params, counts, 0.01), load_imbalance(counts)

    imbalance = []
    for _ in range(150):
        params, layer_imbalance = step(params)
        imbalance.append(np.asarray(layer_imbalance))
    before, after = imbalance[0], np.mean(imbalance[-20:], axis=0)
    assert before.min() > 2.5, before  # the set-up really is lopsided (4 = all on two experts)
    assert (after < 0.5 * before).all() and after.max() < 1.7, (before, after)
