"""Chat messages -> prompt text through the tokenizer's Jinja chat template (Hugging Face's conventions).

Templates come with checkpoints, so they render in a sandbox. Presets have no template: they get a
plain role-tagged one, enough for a byte-level tokenizer and for tests.
"""

from __future__ import annotations

import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(ValueError):
    pass


def _raise_exception(message: str):
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.source = source or DEFAULT_CHAT_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Hugging Face's rendering settings, so a checkpoint's template renders as transformers renders it.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(self.source)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> ChatTemplate:
        # Special-token strings, when the tokenizer knows them; DeepSeek's templates open with {{ bos_token }}.
        return cls(getattr(tokenizer, "chat_template", None), _token_text(tokenizer, "bos"),
                   _token_text(tokenizer, "eos"))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatTemplateError (a ValueError) when the template refuses the conversation."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None

    def encode(self, tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """Prompt text and ids; BOS is added by the tokenizer only when the template did not write it."""
        text = self.render(messages, add_generation_prompt)
        has_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return text, tokenizer.encode(text, add_special_tokens=not has_bos)


def _token_text(tokenizer, which: str) -> str:
    """The special token's text (``bos_token`` / ``eos_token``), or "" when the tokenizer has none."""
    return getattr(tokenizer, f"{which}_token", None) or ""
