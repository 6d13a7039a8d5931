"""The tokenizer built from GGUF metadata, against transformers' reading of the same file."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "The quick brown fox jumps over the lazy dog.\nNew line\ttab",
    "Unicode: café, naïve, 日本語, emoji 🎉",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "def f(x):\n    return x ** two",
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf_path):
    from bench.baselines import hf_model

    return hf_model.tokenizer(smollm2_gguf_path)


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_transformers(smollm2, hf_tokenizer, text):
    assert smollm2.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", [*TEXTS, "Numbers 1234 and 3.14159"])
def test_decode_inverts_encode(smollm2, text):
    tokenizer = smollm2.tokenizer
    special_free = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert tokenizer.decode(tokenizer.encode(special_free)) == special_free


def test_digits_are_split_one_by_one(smollm2):
    """llama.cpp's 'smollm' pre-tokenizer (and SmolLM2's own tokenizer.json) split digits.

    transformers' GGUF converter ignores tokenizer.ggml.pre and would merge them, so
    this is checked against the vocabulary instead.
    """
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode("2024")
    assert [tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_tokens_are_single_ids(smollm2):
    tokenizer = smollm2.tokenizer
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.eos_ids == [2]


def test_chat_template_matches_transformers(smollm2, hf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = smollm2.tokenizer.apply_chat_template(messages)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
