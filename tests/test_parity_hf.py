"""SmolLM2 in jlora vs Hugging Face transformers (PyTorch) on the same GGUF file.

Both sides dequantize the same Q4_1 tensors to fp32, and the PyTorch side gets the
token ids jlora's tokenizer produced, so this compares the models alone.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jlora.engine.api import SamplingParams
from jlora.model.loading import load_model
from tests.engine_helpers import make_engine, run_to_completion
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
    assert_close(ours, theirs, jnp.float32, np.float32, scope="model")
    assert np.argmax(ours) == np.argmax(theirs)


def test_bf16_serving_stays_close_to_the_fp32_oracle(hf_smollm2):
    """bf16 weights and activations: logits within the bf16 model bound, same top tokens."""
    bf16 = load_model("smollm2-135m", jnp.bfloat16)
    for prompt in PROMPTS:
        ids = bf16.tokenizer.encode(prompt)
        ours = jlora_last_logits(bf16, ids)
        theirs = hf_last_logits(hf_smollm2, ids)
        assert_close(ours, theirs, jnp.bfloat16, np.float32, scope="model")
        assert np.argmax(theirs) in np.argsort(-ours)[:3]


def test_a_bf16_engine_decodes_what_its_prefills_pick():
    """A bf16 engine on a CPU serves (XLA:CPU has no bf16 x bf16 -> f32 dot; dots.py): each
    greedy token of its decode is the argmax, to within bf16 rounding, of a bf16 prefill
    over the text so far (the two sum in different orders: at the third token here the
    top two logits differ by 2e-4)."""
    bf16 = load_model("smollm2-135m", jnp.bfloat16)
    ids = bf16.tokenizer.encode(PROMPTS[1])
    engine = make_engine(bf16, dtype="bfloat16", max_slots=2, max_seq_len=128)
    try:
        [result] = run_to_completion(engine, [ids], SamplingParams(max_tokens=6, ignore_eos=True))
    finally:
        engine.close()
    generated = result["token_ids"]
    assert len(generated) == 6
    for n, token in enumerate(generated):
        logits = jlora_last_logits(bf16, ids + generated[:n])
        assert logits[token] >= logits.max() - 0.05, (n, token, int(np.argmax(logits)))


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
    engine = make_engine(smollm2, max_slots=4, max_seq_len=256)
    ours = run_to_completion(engine, prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for ids, result in zip(prompts, ours, strict=True):
        generated = result["token_ids"]
        assert len(generated) == 32
        assert generated == _hf_greedy(hf_smollm2, ids, 32), tokenizer.decode(ids)
