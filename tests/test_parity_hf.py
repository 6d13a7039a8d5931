"""SmolLM2 in jlora vs Hugging Face transformers (PyTorch) on the same GGUF file.

Both sides dequantize the same Q4_1 tensors to fp32, and the PyTorch side gets the
token ids jlora's tokenizer produced, so this compares the models alone.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from configs import EngineConfig
from jlora.engine.api import Request, SamplingParams
from jlora.engine.engine import LLMEngine
from tests.model_helpers import hf_last_logits, jlora_last_logits
from tests.tolerances import assert_close

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
]
CHATS = ["What is the capital of France?", "Write a haiku about the ocean."]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_position_logits_match_transformers(smollm2, hf_smollm2, prompt):
    ids = smollm2.tokenizer.encode(prompt)
    ours = jlora_last_logits(smollm2, ids)
    theirs = hf_last_logits(hf_smollm2, ids)
    assert_close(ours, theirs, jnp.float32, np.float32)
    assert np.argmax(ours) == np.argmax(theirs)


def _greedy_engine(loaded) -> LLMEngine:
    return LLMEngine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        engine_config=EngineConfig(max_slots=4, max_seq_len=256),
    )


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", ids, sampling))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for event in engine.step():
            out[event.request_id].append(event.token_id)
    return [out[f"r{i}"] for i in range(len(prompts))]


def _hf_greedy(hf_model, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with transformers' KV cache, not stopping at EOS (like ignore_eos)."""
    generated: list[int] = []
    inputs, past = torch.tensor([ids]), None
    with torch.no_grad():
        for _ in range(max_tokens):
            out = hf_model(inputs, past_key_values=past, use_cache=True)
            past = out.past_key_values
            generated.append(int(out.logits[0, -1].argmax()))
            inputs = torch.tensor([[generated[-1]]])
    return generated


def test_greedy_continuations_match_transformers(smollm2, hf_smollm2):
    tokenizer = smollm2.tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    prompts += [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}]))
        for c in CHATS
    ]
    ours = _generate(_greedy_engine(smollm2), prompts, max_tokens=32)
    for ids, generated in zip(prompts, ours, strict=True):
        assert len(generated) == 32
        assert generated == _hf_greedy(hf_smollm2, ids, 32), tokenizer.decode(ids)
