"""Server settings: defaults, YAML files, flag overrides, and errors that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsjax.config import ConfigError
from dsjax.serve.config import ServeConfig, config_from_args, load_yaml, parse_memory

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "serve"


def test_no_arguments_serve_the_embedded_default_on_localhost_8000():
    config = config_from_args([])
    assert (config.model, config.host, config.port) == ("default", "127.0.0.1", 8000)
    assert config.model_name == "default"


@pytest.mark.parametrize("name", ["default.yaml", "tiny-cpu.yaml"])
def test_shipped_configs_load(name):
    config = config_from_args(["--config", str(CONFIGS / name)])
    config.engine_config()


def test_flags_override_the_file():
    config = config_from_args(["--config", str(CONFIGS / "tiny-cpu.yaml"), "--max-num-seqs", "4",
                               "--no-enable-prefix-caching", "--served-model-name", "m", "--kv-cache-memory", "0.5",
                               "--num-scheduler-steps", "4"])
    assert config.max_num_seqs == 4 and config.enable_prefix_caching is False and config.model_name == "m"
    assert config.kv_cache_memory == 0.5
    assert config.max_num_batched_tokens == 32  # from the file
    engine = config.engine_config()
    assert engine.max_num_seqs == 4 and engine.enable_prefix_caching is False and engine.num_scheduler_steps == 4


def test_unknown_yaml_key_names_the_key_and_the_accepted_ones(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: tiny\nmax_num_seq: 4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'max_num_seq'.*accepted keys:.*max_num_seqs"):
        load_yaml(path)


def test_yaml_keys_may_use_dashes(tmp_path):
    path = tmp_path / "dashes.yaml"
    path.write_text("max-model-len: 256\n")
    assert config_from_args(["--config", str(path)]).max_model_len == 256


@pytest.mark.parametrize("changes, field", [
    (dict(port=70000), "port"), (dict(max_n=0), "max_n"), (dict(dtype="fp8"), "dtype"),
    (dict(max_queue_len=-1), "max_queue_len"), (dict(max_num_seqs=True), "max_num_seqs"),
    (dict(block_size=3), "block_size"),  # refused by EngineConfig, at parse time
    (dict(num_scheduler_steps=0), "num_scheduler_steps"),
])
def test_bad_values_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        ServeConfig(**changes)


def test_api_key_from_environment():
    assert config_from_args([], env={"DSJAX_API_KEY": "k"}).api_key == "k"
    assert config_from_args(["--api-key", "flag"], env={"DSJAX_API_KEY": "k"}).api_key == "flag"


@pytest.mark.parametrize("text, value", [("0.8", 0.8), ("1024", 1024), ("2GiB", 2 << 30), ("512MB", 512 * 10**6)])
def test_kv_cache_memory_sizes(text, value):
    assert parse_memory(text) == value


def test_kv_cache_memory_refuses_nonsense():
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        parse_memory("lots")
