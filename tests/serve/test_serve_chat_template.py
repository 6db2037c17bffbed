"""Chat templates: Hugging Face-style Jinja in a sandbox, BOS written once, template errors as ValueErrors."""

from __future__ import annotations

import pytest

from dsjax.serve.chat_template import ChatTemplate, ChatTemplateError
from dsjax.tokenizer import ByteTokenizer

# The shape of DeepSeek's templates: BOS first, role markers, raise_exception on what they refuse.
DEEPSEEK_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}User: {{ m['content'] }}\n\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% else %}{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


class RecordingTokenizer(ByteTokenizer):
    def __init__(self):
        super().__init__(512)
        self.calls = []

    def encode(self, text, add_special_tokens=True):
        self.calls.append(add_special_tokens)
        return super().encode(text, add_special_tokens)


def test_hf_template_renders_and_bos_is_not_doubled():
    template = ChatTemplate(DEEPSEEK_LIKE, bos_token="<s>", eos_token="</s>")
    tokenizer = RecordingTokenizer()
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    text, ids = template.encode(tokenizer, messages)
    assert text == "<s>Be terse.\n\nUser: Hi\n\nAssistant: Hello</s>User: Again\n\nAssistant:"
    assert tokenizer.calls == [False]  # the template wrote BOS: the tokenizer must not add another
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def test_template_refusal_is_a_value_error():
    with pytest.raises(ChatTemplateError, match="unsupported role tool"):
        ChatTemplate(DEEPSEEK_LIKE, bos_token="<s>").render([{"role": "tool", "content": "x"}])


def test_sandbox_blocks_attribute_escapes():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_default_template_for_tokenizers_without_one():
    template = ChatTemplate.for_tokenizer(ByteTokenizer(512))
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<|user|>\nhi\n<|assistant|>\n"
    assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<|user|>\nhi\n"
