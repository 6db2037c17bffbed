"""Incremental detokenization and stop strings, one sequence at a time (pure Python).

Decoding only the newest tokens against a short window of the previous ones keeps each step O(1)
while still producing exactly what decoding the whole output would: a window that ends inside a
multi-byte character (U+FFFD) waits for the next token.
"""

from __future__ import annotations

_PROMPT_CONTEXT = 5  # prompt tokens kept as left context (tokenizers that merge leading spaces)


class IncrementalDetokenizer:
    """``deferred``: nobody reads the text before the end (offline requests without stop strings), so
    append() only records the token and flush() decodes the whole output in one call, instead of two
    decode calls a token on the engine's critical path."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (), *,
                 deferred: bool = False):
        if deferred and stop:
            raise ValueError("a deferred detokenizer cannot watch for stop strings")
        self.tokenizer = tokenizer
        self.stop = stop
        self.deferred = deferred
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_output_tokens = 0
        self.text = ""
        self.stop_reason: str | None = None  # the stop string that ended the text, if any

    def append(self, token_id: int) -> str:
        """Adds one generated token; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        self._num_output_tokens += 1
        if self.deferred:
            return ""
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._extend(delta)

    def _extend(self, delta: str) -> str:
        start = len(self.text)
        self.text += delta
        if self.stop:
            longest = max(map(len, self.stop))
            window_start = max(0, start - longest + 1)
            hits = [(self.text.find(s, window_start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, self.stop_reason = min(hits)
                self.text = self.text[:index]  # the stop string itself is not returned (vLLM's default)
                return self.text[start:] if index > start else ""
        return delta

    def flush(self) -> str:
        """At the end: whatever the last window still held back (an incomplete character)."""
        if self.stop_reason is not None:
            return ""
        if self.deferred:  # the context the incremental path starts from, then everything after it
            context = self.tokenizer.decode(self._ids[:self._read_offset])
            self.text = self.tokenizer.decode(self._ids)[len(context):]
            self._prefix_offset = self._read_offset = len(self._ids)
            return self.text
        rest = self.tokenizer.decode(self._ids[self._read_offset:]) if self._read_offset < len(self._ids) else ""
        if not rest:
            return ""
        full = self.tokenizer.decode(self._ids[self._prefix_offset:])
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        self._read_offset = len(self._ids)
        return self._extend(full[len(prefix):])
