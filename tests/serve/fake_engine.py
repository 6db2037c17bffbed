"""LLMEngine without a model, for fast in-process serve tests.

The real scheduler, block manager, detokenizer and step()/add/abort code run; only the runner is
fake: the token a sequence draws at output position p is the letter 'a' + p % 26, so completions
read "abcdef..." and stop strings are predictable. A gate (threading.Event) can hold steps back to
build queues on purpose.
"""

from __future__ import annotations

import threading
import time
import types

import numpy as np

from dsjax.config import EngineConfig
from dsjax.engine.buckets import Buckets
from dsjax.engine.llm_engine import LLMEngine
from dsjax.engine.runner import StepResult
from dsjax.tokenizer import ByteTokenizer

VOCAB_SIZE = 512
LETTER_A = ByteTokenizer.OFFSET + ord("a")


class FakeRunner:
    def __init__(self, config: EngineConfig, step_delay: float = 0.0):
        self.config = config
        self.model_config = types.SimpleNamespace(vocab_size=VOCAB_SIZE)
        self.buckets = Buckets.pow2(1, config.max_num_batched_tokens)
        self.num_useful_tokens = self.num_padded_tokens = 0
        self.num_block_copies = 0
        self.cache_was_reset = False
        self.num_compiled_shapes = len(self.buckets)
        self.compile_seconds = 0.0
        self.step_delay = step_delay
        self.gate = threading.Event()
        self.gate.set()

    def dispatch(self, out, rows, pending_rows=None) -> StepResult:
        """The step's result stands in for its handle: the fake device is done when dispatch returns."""
        self.gate.wait()
        if self.step_delay:
            time.sleep(self.step_delay)
        n = len(rows)
        k = max([r.num_logprobs for r in rows] + [1])
        token_ids = np.asarray([LETTER_A + r.counter % 26 for r in rows], np.int32)
        top_ids = (token_ids[:, None] + np.arange(k)[None, :]).astype(np.int32)  # the drawn token ranks first
        top_logprobs = np.tile(-np.arange(1, k + 1, dtype=np.float32) * 0.5, (n, 1))
        self.num_useful_tokens += out.num_batched_tokens
        self.num_padded_tokens += self.buckets.pick(out.num_batched_tokens)
        return StepResult(token_ids, top_logprobs[:, 0].copy(), top_ids, top_logprobs)

    def fetch(self, handle: StepResult) -> StepResult:
        return handle

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Partial prefix-cache hits: the fake device holds no KV, it only counts the copies."""
        self.num_block_copies += len(pairs)

    @property
    def padding_ratio(self) -> float:
        padded = self.num_padded_tokens
        return (padded - self.num_useful_tokens) / padded if padded else 0.0


class FakeEngine(LLMEngine):
    def __init__(self, config: EngineConfig | None = None, *, step_delay: float = 0.0,
                 num_kv_blocks: int | None = None):
        config = config or EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=8)
        tokenizer = ByteTokenizer(VOCAB_SIZE)
        self._setup_host(config, tokenizer, num_kv_blocks or config.max_num_seqs * config.max_blocks_per_seq,
                         tuple(tokenizer.eos_token_ids))
        self.runner = FakeRunner(config, step_delay)


def expected_text(num_tokens: int, start: int = 0) -> str:
    return "".join(chr(ord("a") + (start + i) % 26) for i in range(num_tokens))
