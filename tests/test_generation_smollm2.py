"""End-to-end generation with the real SmolLM2: batching invariance, EOS, stop strings."""

from __future__ import annotations

import pytest

from jlora.engine.api import SamplingParams
from tests.engine_helpers import make_engine, run_to_completion

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "The three primary colors are",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. Describe how",
    "Here is a long list of fruits: apple, banana, cherry, date, elderberry, fig, grape, "
    "honeydew, kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry, and",
    "Translate to French: good morning",
]


@pytest.fixture(scope="module")
def engine_factory(smollm2):
    return lambda: make_engine(smollm2, max_slots=4, max_seq_len=256)


def test_batch_of_different_lengths_equals_each_alone(smollm2, engine_factory):
    prompts = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    together = run_to_completion(engine_factory(), prompts, sampling)
    engine = engine_factory()
    for ids, result in zip(prompts, together, strict=True):
        assert run_to_completion(engine, [ids], sampling)[0] == result


def test_chat_answer_stops_at_eos(smollm2, engine_factory):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}]
        )
    )
    [result] = run_to_completion(engine_factory(), [ids], SamplingParams(max_tokens=64))
    assert result["finish_reason"] == "stop"
    assert result["token_ids"][-1] in tokenizer.eos_ids
    assert "Paris" in result["text"] and "<|im_end|>" not in result["text"]
    assert result["text"] == tokenizer.decode(result["token_ids"])


def test_stop_string_ends_the_text_before_it(smollm2, engine_factory):
    ids = smollm2.tokenizer.encode("Count: one, two, three, four, five,")
    free, stopped = run_to_completion(
        engine_factory(),
        [ids, ids],
        [
            SamplingParams(max_tokens=20, ignore_eos=True),
            SamplingParams(max_tokens=20, stop=("eight",)),
        ],
    )
    assert "eight" in free["text"]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == free["text"][: free["text"].index("eight")]
