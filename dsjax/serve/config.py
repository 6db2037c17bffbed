"""Server settings: one frozen dataclass, filled from defaults, then a YAML file, then flags.

Flag names follow vLLM's (``--max-model-len``); the YAML file uses the same names with underscores
(dashes are accepted too). Engine fields left unset keep EngineConfig's defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from dsjax.config import KV_CACHE_DTYPES, ConfigError, EngineConfig, ParallelConfig

DTYPES = ("auto", "float32", "bfloat16")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# The engine fields the server exposes; None means "EngineConfig's default".
ENGINE_FIELDS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory",
                 "num_kv_blocks", "kv_cache_dtype", "kv_cache_group_size", "full_precision_window", "enable_prefix_caching", "enable_chunked_prefill", "async_scheduling",
                 "num_scheduler_steps", "max_logprobs", "seed")
# The ParallelConfig fields the server exposes; None means "the --parallel-config file's, or 1".
PARALLEL_FIELDS = ("tensor_parallel_size", "expert_parallel_size", "data_parallel_size", "coordinator_address",
                   "num_processes", "process_id")
# Multi-host settings may come from the environment (one launcher line for every host).
PARALLEL_ENV = {"coordinator_address": "DSJAX_COORDINATOR_ADDRESS", "num_processes": "DSJAX_NUM_PROCESSES",
                "process_id": "DSJAX_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str = "default"  # the embedded trained model (models/default); a path or preset name otherwise
    served_model_name: str | None = None  # the name /v1/models lists and requests must use; default: model
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    dtype: str = "auto"  # bfloat16 on an accelerator, float32 on CPU
    kernel_backend: str = "auto"
    # engine (see ENGINE_FIELDS)
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    kv_cache_memory: int | float | None = None
    num_kv_blocks: int | None = None
    kv_cache_dtype: str | None = None  # auto, int8, fp8
    kv_cache_group_size: int | None = None
    full_precision_window: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    async_scheduling: bool | None = None
    num_scheduler_steps: int | None = None
    max_logprobs: int | None = None
    seed: int | None = None
    # devices (see PARALLEL_FIELDS; docs/parallelism.md)
    parallel_config: str | None = None  # YAML file or preset name (configs/parallel/)
    tensor_parallel_size: int | None = None
    expert_parallel_size: int | None = None
    data_parallel_size: int | None = None
    coordinator_address: str | None = None  # multi-host: process 0's host:port
    num_processes: int | None = None
    process_id: int | None = None
    # admission and limits
    max_queue_len: int = 256  # waiting sequences (n counts each) before new requests get 503
    max_n: int = 16  # the largest n a request may ask for
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    drain_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests before exiting anyway
    log_level: str = "info"

    def __post_init__(self):
        _check_int("port", self.port, 0, "an int in [0, 65535]", upper=65535)
        _check_int("max_queue_len", self.max_queue_len, 0, "an int >= 0")
        for name in ("max_n", "max_body_bytes"):
            _check_int(name, getattr(self, name), 1, "an int >= 1")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                     "num_scheduler_steps"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1, "an int >= 1 (or unset)")
        if not isinstance(self.drain_timeout, (int, float)) or isinstance(self.drain_timeout, bool) \
                or self.drain_timeout < 0:
            raise _refuse("drain_timeout", self.drain_timeout, "seconds, a number >= 0")
        if self.dtype not in DTYPES:
            raise _refuse("dtype", self.dtype, ", ".join(DTYPES))
        if self.log_level not in LOG_LEVELS:
            raise _refuse("log_level", self.log_level, ", ".join(LOG_LEVELS))
        for name in ("model", "host", "kernel_backend"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _refuse(name, getattr(self, name), "a non-empty string")
        for name in ("served_model_name", "api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _refuse(name, value, "a non-empty string (or unset)")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise _refuse(name, getattr(self, name), "true or false")
        if isinstance(self.kv_cache_memory, str):
            object.__setattr__(self, "kv_cache_memory", parse_memory(self.kv_cache_memory))
        self.engine_config()  # EngineConfig refuses bad engine values now, not after the model loads
        self.parallel()

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self) -> EngineConfig:
        """The engine's config: the fields set here over EngineConfig's defaults (it validates them)."""
        return EngineConfig(**{name: getattr(self, name) for name in ENGINE_FIELDS if getattr(self, name) is not None})

    def parallel(self) -> ParallelConfig:
        """The --parallel-config file's settings (or the defaults), with the fields set here over them."""
        base = ParallelConfig() if self.parallel_config is None else ParallelConfig.from_yaml(self.parallel_config)
        given = {name: getattr(self, name) for name in PARALLEL_FIELDS if getattr(self, name) is not None}
        return base.replace(**given)

    def replace(self, **changes: Any) -> ServeConfig:
        return dataclasses.replace(self, **changes)


FIELDS = tuple(f.name for f in dataclasses.fields(ServeConfig))


def _refuse(field: str, value: Any, accepted: str) -> ConfigError:
    return ConfigError(f"serve setting {field!r} = {value!r} is not accepted; accepted: {accepted}")


def _check_int(name: str, value: Any, lower: int, accepted: str, upper: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lower or (upper is not None and value > upper):
        raise _refuse(name, value, accepted)


_MEMORY_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_memory(text: str) -> int | float:
    """'0.8' -> a fraction of free memory; '1073741824' or '1GiB' or '512MB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise _refuse("kv_cache_memory", text, "a fraction in (0, 1], bytes, or a size like 2GiB / 512MB")
    number = match.group(1)
    if "." in number and not unit:
        return float(number)
    return int(float(number) * _MEMORY_UNITS[unit])


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The settings of a YAML file; keys may use dashes or underscores. Unknown keys are an error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {str(path)!r}: no such file")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {str(path)!r}: accepted a mapping of settings, got {type(data).__name__}")
    settings = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"--config {str(path)!r}: unknown key {key!r}; accepted keys: {', '.join(FIELDS)}")
        settings[name] = value
    return settings


def build_parser() -> argparse.ArgumentParser:
    # Every default is SUPPRESS: only flags given on the command line override the file and the defaults.
    p = argparse.ArgumentParser(prog="python -m dsjax.serve", argument_default=argparse.SUPPRESS,
                                description="OpenAI-compatible HTTP server for a dsjax model.")
    p.add_argument("--config", help="YAML file of settings (configs/serve/*.yaml); flags override it")
    p.add_argument("--model", help="embedded model name, preset name or checkpoint directory (default: default, "
                   "the trained model in models/default)")
    p.add_argument("--served-model-name", help="model name clients use (default: --model)")
    p.add_argument("--host", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (default: 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: $DSJAX_API_KEY)")
    p.add_argument("--dtype", choices=DTYPES, help="weights and activations (default: auto)")
    p.add_argument("--kernel-backend", help="attention/MoE kernels (default: auto)")
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens per request")
    p.add_argument("--max-num-seqs", type=int, help="sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per engine step (largest bucket)")
    p.add_argument("--block-size", type=int, help="tokens per KV block")
    p.add_argument("--kv-cache-memory", type=parse_memory, help="KV pool: fraction of free memory, bytes, or 2GiB")
    p.add_argument("--num-kv-blocks", type=int, help="exact KV pool size in blocks (overrides --kv-cache-memory)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="latent cache storage: auto (the model's dtype), int8 or fp8 (e4m3) with f32 scales")
    p.add_argument("--kv-cache-group-size", type=int,
                   help="latent elements per scale of an 8-bit cache (default: one scale per token)")
    p.add_argument("--full-precision-window", type=int,
                   help="keep each sequence's most recent N tokens in the model's dtype, older blocks in "
                        "--kv-cache-dtype (int8/fp8)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   help="queue each engine step before reading the previous one's tokens (host work overlaps "
                        "the device's)")
    p.add_argument("--num-scheduler-steps", type=int,
                   help="decode steps one launch runs on the device when every running sequence decodes "
                        "(default: 1); tokens then stream in chunks of that many")
    p.add_argument("--max-logprobs", type=int, help="largest logprobs / top_logprobs a request may ask for")
    p.add_argument("--seed", type=int, help="engine seed for requests without one")
    p.add_argument("--parallel-config", help="YAML of parallel sizes (configs/parallel/*.yaml, or a preset name)")
    p.add_argument("--tensor-parallel-size", type=int, help="split heads, MLP and expert columns (default: 1)")
    p.add_argument("--expert-parallel-size", type=int, help="split routed experts and sequences (default: 1)")
    p.add_argument("--data-parallel-size", type=int, help="split sequences over expert-parallel replicas (default: 1)")
    p.add_argument("--coordinator-address", help="multi-host: host:port of process 0 ($DSJAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, help="multi-host: processes in the run ($DSJAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="multi-host: this process, 0 serves HTTP ($DSJAX_PROCESS_ID)")
    p.add_argument("--max-queue-len", type=int, help="waiting sequences before new requests get 503 (default: 256)")
    p.add_argument("--max-n", type=int, help="largest n per request (default: 16)")
    p.add_argument("--max-body-bytes", type=int, help="request body limit; larger gets 413 (default: 4 MiB)")
    p.add_argument("--drain-timeout", type=float, help="seconds SIGTERM waits for in-flight requests (default: 30)")
    p.add_argument("--log-level", choices=LOG_LEVELS)
    return p


def config_from_args(argv: list[str] | None = None, env: dict[str, str] | None = None) -> ServeConfig:
    """Defaults, then --config's file, then the flags; the API key may come from $DSJAX_API_KEY."""
    args = vars(build_parser().parse_args(argv))
    settings = load_yaml(args.pop("config")) if "config" in args else {}
    settings.update(args)
    if "api_key" not in settings and env and env.get("DSJAX_API_KEY"):
        settings["api_key"] = env["DSJAX_API_KEY"]
    for name, var in PARALLEL_ENV.items():
        if name not in settings and env and env.get(var):
            value = env[var]
            try:
                settings[name] = value if name == "coordinator_address" else int(value)
            except ValueError:
                raise _refuse(name, value, f"an integer (from ${var})") from None
    return ServeConfig(**settings)
