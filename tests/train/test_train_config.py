"""Training configs, the CLI's flags and the corpus split (no training here)."""

from __future__ import annotations

import pytest

from dsjax.config import ConfigError
from dsjax.train.__main__ import parse_args
from dsjax.train.config import TrainConfig, load_train_config
from dsjax.train.corpus import load_corpus, stdlib_files, stdlib_root
from dsjax.train.pipeline import DEFAULT_CONFIG

TINY_CONFIG = DEFAULT_CONFIG.with_name("tiny.yaml")


def _pow2(n):
    return n > 0 and n & (n - 1) == 0


def test_default_model_config_fits_the_repository_and_the_kernels():
    config, train, _ = load_train_config(DEFAULT_CONFIG)
    assert config.model_type == "deepseek_v3" and config.topk_method == "noaux_tc"
    assert config.scoring_func == "sigmoid" and config.n_shared_experts == 1
    assert 4 <= config.n_routed_experts <= 16
    num_params = config.num_params() + config.num_moe_layers * config.n_routed_experts  # + router biases
    assert 5e6 <= num_params <= 15e6
    assert 2 * num_params < 30e6  # bf16 safetensors
    for dim in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        assert _pow2(getattr(config, dim)), dim
    assert 4096 <= config.vocab_size <= 8192 and (config.bos_token_id, config.eos_token_ids) == (0, (1,))
    assert train.dtype == "bfloat16" and train.export_dtype == "bfloat16"


def test_tiny_config_loads():
    config, train, section = load_train_config(TINY_CONFIG)
    assert train.dtype == "float32" and train.max_files == 6 and section["vocab_size"] == config.vocab_size


def test_bad_settings_are_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(TINY_CONFIG.read_text().replace("steps: 40", "steps: 40\n  stpes: 3"))
    with pytest.raises(ConfigError, match="unknown train keys.*stpes"):
        load_train_config(path)
    with pytest.raises(ConfigError, match="'dtype' = 'float16'.*float32, bfloat16"):
        TrainConfig(dtype="float16")
    with pytest.raises(ConfigError, match="'min_learning_rate'"):
        TrainConfig(learning_rate=1e-3, min_learning_rate=1e-2)
    path.write_text(TINY_CONFIG.read_text().replace("seq_len: 64", "seq_len: 1024"))
    with pytest.raises(ConfigError, match="max_position_embeddings=512"):
        load_train_config(path)


def test_cli_flags():
    args = parse_args(["--steps", "5", "--batch-size", "2", "--seq-len", "16", "--dtype", "float32", "--max-files",
                       "3", "--resume", "--out", "o", "--work-dir", "w"])
    assert (args.steps, args.batch_size, args.seq_len, args.dtype, args.max_files, args.resume) == \
        (5, 2, 16, "float32", 3, True)
    assert TrainConfig().replace(steps=args.steps, batch_size=None).steps == 5  # None keeps the file's value


def test_corpus_split_is_deterministic_and_holds_out_whole_modules():
    files = stdlib_files(stdlib_root())
    rel = [p.relative_to(stdlib_root()).as_posix() for p in files]
    assert rel == sorted(rel) and not any("/test/" in f"/{r}" or "site-packages" in r for r in rel)
    corpus = load_corpus(("json", "textwrap", "no_such_module"))
    assert corpus.heldout_modules == ("json", "textwrap")
    held = {p.relative_to(corpus.root).as_posix() for p in corpus.heldout_files}
    assert "textwrap.py" in held and "json/__init__.py" in held
    assert not held & {p.relative_to(corpus.root).as_posix() for p in corpus.train_files}
    assert len(corpus.train_files) + len(corpus.heldout_files) == len(files)
    small = load_corpus(("json",), max_files=5)
    assert len(small.train_files) == 5 and small.train_files == load_corpus(("json",), max_files=5).train_files
    assert small.heldout_files == load_corpus(("json",)).heldout_files


def test_corpus_falls_back_to_a_hash_split():
    corpus = load_corpus(("no_such_module",))
    total = len(corpus.train_files) + len(corpus.heldout_files)
    assert corpus.heldout_modules == ("hash split",)
    assert 0 < len(corpus.heldout_files) < 0.05 * total
