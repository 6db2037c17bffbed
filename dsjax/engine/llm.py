"""The offline API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
from tqdm.auto import tqdm

from dsjax.config import EngineConfig, ParallelConfig
from dsjax.engine.llm_engine import LLMEngine
from dsjax.engine.outputs import RequestOutput
from dsjax.engine.sampling_params import SamplingParams
from dsjax.loader import DEFAULT_MODEL, load_model, load_tokenizer
from dsjax.parallel.mesh import prepare_process


class LLM:
    """``LLM(model="default").generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))``.

    Several devices: ``tensor_parallel_size=``, ``expert_parallel_size=``, ``data_parallel_size=``
    (vLLM's names), or ``parallel=`` a ParallelConfig or a YAML file (configs/parallel/); sizes given
    here override the file's. Multi-host: every process constructs the same LLM with a ParallelConfig
    naming the coordinator and its process_id, then makes the same calls.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", *, kernel_backend: str = "auto",
                 tokenizer: str | None = None, seed: int = 0, progress: bool = True,
                 tensor_parallel_size: int | None = None, expert_parallel_size: int | None = None,
                 data_parallel_size: int | None = None, parallel: ParallelConfig | str | Path | None = None,
                 **engine_args):
        parallel = parallel_config(parallel, tensor_parallel_size=tensor_parallel_size,
                                   expert_parallel_size=expert_parallel_size, data_parallel_size=data_parallel_size)
        prepare_process(parallel)  # before anything touches a device
        if dtype == "auto":
            dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
        self.model = load_model(model, dtype=dtype, kernel_backend=kernel_backend, progress=progress,
                                parallel=parallel)
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.engine = LLMEngine(self.model, self.tokenizer, EngineConfig(seed=seed, **engine_args),
                                progress=progress)
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, or a list of token-id lists."""
        prompts = _normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
        max_len = self.engine.config.max_model_len
        encoded = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if len(ids) + params.max_tokens > max_len:
                raise ValueError(f"prompt {i}: {len(ids)} prompt tokens + max_tokens={params.max_tokens} "
                                 f"exceed max_model_len={max_len}; shorten it or lower max_tokens (no silent truncation)")
            encoded.append((prompt if isinstance(prompt, str) else None, ids, params))
        order = []
        for prompt, ids, params in encoded:
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, prompt, params, prompt_token_ids=ids, final_only=True)
            order.append(request_id)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="generating", unit="req",
                  disable=not use_tqdm or len(order) < 2) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        return [done[r] for r in order]

    def stats(self) -> dict:
        return self.engine.stats()


def parallel_config(parallel: ParallelConfig | str | Path | None = None, **sizes: int | None) -> ParallelConfig:
    """A ParallelConfig from a config, a YAML file or preset name, or nothing; sizes given override it."""
    if parallel is None:
        parallel = ParallelConfig()
    elif not isinstance(parallel, ParallelConfig):
        parallel = ParallelConfig.from_yaml(parallel)
    return parallel.replace(**{name: value for name, value in sizes.items() if value is not None})


def _normalize_prompts(prompts):
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    return prompts
