"""ModelConfig parsing, presets and the errors for values we do not run."""

from __future__ import annotations

import pytest

from dsjax.config import ConfigError, ModelConfig, list_presets


def _hf(**overrides):
    return {**ModelConfig.tiny().to_hf(), **overrides}


def test_presets_parse_with_expected_sizes():
    assert list_presets() == ["deepseek-v2-lite", "deepseek-v3", "tiny"]
    assert 1e6 < ModelConfig.tiny().num_params() < 1e7
    assert round(ModelConfig.preset("deepseek-v2-lite").num_params() / 1e9, 1) == 15.7
    assert round(ModelConfig.preset("deepseek-v3").num_params() / 1e9) == 671


def test_to_hf_round_trip():
    for name in list_presets():
        config = ModelConfig.preset(name)
        assert ModelConfig.from_hf(config.to_hf()) == config


def test_yarn_scales_match_deepseek():
    v2 = ModelConfig.preset("deepseek-v2-lite")
    # mscale == mscale_all_dim: cos/sin untouched, softmax scale grows by (0.1*0.707*ln 40 + 1)^2.
    assert v2.rope_scaling.cos_sin_scale == pytest.approx(1.0)
    assert v2.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * 3.6888794541 + 1) ** 2)


@pytest.mark.parametrize("field,value,accepted", [
    ("model_type", "llama", "deepseek_v2, deepseek_v3"),
    ("topk_method", "sinkhorn", "greedy, group_limited_greedy, noaux_tc"),
    ("scoring_func", "relu", "softmax, sigmoid"),
    ("moe_layer_freq", 2, "1 (every layer"),
    ("hidden_act", "gelu", "silu"),
    ("n_group", 3, "a divisor of n_routed_experts=8"),
    ("num_experts_per_tok", 9, "an integer in [1, n_routed_experts=8]"),
])
def test_unsupported_values_name_field_and_accepted(field, value, accepted):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf(_hf(**{field: value}))
    assert repr(field) in str(err.value) and repr(value) in str(err.value) and accepted in str(err.value)


def test_unsupported_rope_type():
    with pytest.raises(ConfigError, match=r"rope_type' = 'dynamic'.*default, yarn"):
        ModelConfig.from_hf(_hf(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}))


def test_v2_ignores_norm_topk_prob_like_transformers():
    config = ModelConfig.from_hf(dict(ModelConfig.preset("deepseek-v2-lite").to_hf(), norm_topk_prob=True))
    assert config.norm_topk_prob is False and config.rope_interleave is True


def test_eos_list_and_null_q_lora():
    config = ModelConfig.from_hf(_hf(eos_token_id=[1, 5], q_lora_rank=None))
    assert config.eos_token_ids == (1, 5) and config.q_lora_rank is None
