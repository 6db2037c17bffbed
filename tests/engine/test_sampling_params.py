import dataclasses

import pytest

from dsjax.engine.sampling_params import SamplingParams


def test_defaults_match_vllm_shape():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k) == (1, 16, 1.0, 1.0, 0)
    assert (p.min_tokens, p.seed, p.stop, p.stop_token_ids) == (0, None, (), ())
    assert (p.ignore_eos, p.logprobs, p.priority) == (False, None, "default")
    assert not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy


def test_stop_is_normalized_to_a_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[5, 7]).stop_token_ids == (5, 7)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_frozen_and_hashable():
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3
    assert hash(p) == hash(SamplingParams(stop="x", stop_token_ids=(1,)))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(n=0), ["n=0", ">= 1"]),
        (dict(max_tokens=0), ["max_tokens=0", ">= 1"]),
        (dict(max_tokens=True), ["max_tokens=True"]),
        (dict(temperature=-0.5), ["temperature=-0.5", ">= 0"]),
        (dict(temperature=float("nan")), ["temperature=nan"]),
        (dict(top_p=0.0), ["top_p=0.0", "(0, 1]"]),
        (dict(top_p=1.5), ["top_p=1.5"]),
        (dict(top_k=-1), ["top_k=-1", "0 (off)"]),
        (dict(min_tokens=20, max_tokens=10), ["min_tokens=20", "max_tokens=10"]),
        (dict(seed=1.5), ["seed=1.5"]),
        (dict(stop=["ok", ""]), ["stop=", "non-empty"]),
        (dict(stop_token_ids=[3, -1]), ["stop_token_ids=", "-1"]),
        (dict(ignore_eos=1), ["ignore_eos=1"]),
        (dict(logprobs=-2), ["logprobs=-2"]),
        (dict(priority="urgent"), ["priority='urgent'", "realtime", "bulk"]),
    ],
)
def test_errors_name_field_value_and_accepted(kwargs, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    for word in words:
        assert word in str(info.value)
