"""Log-probabilities of prompt and generated tokens against transformers' log-softmax.

A tiny random Llama 3 (written by transformers) and a PEFT adapter on all its
projections. Requests ask for `logprobs` (each generated token's, and the 5 most
likely there) and `prompt_logprobs` (every prompt token's after the first); each value
must be transformers' (or PEFT's) log-softmax at that position of the whole sequence,
for base and adapter rows in one batch, through every path a prompt may take: one
prefill, a packed prefill, chunks, a prompt the prefix cache could have served, merged
weights, CPU assistance.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from jlora.engine.api import Request, SamplingParams
from tests.engine_helpers import make_engine
from tests.model_helpers import TINY_HF, tiny_llama_with_adapter

pytestmark = pytest.mark.slow

TOP = 5
PROMPT_LENGTHS = (5, 23, 40, 9)
ROWS = [None, "a", "a", None]  # each prompt's adapter
SERVING = {  # name -> engine options
    "one-by-one": dict(packed_prefill_prompts=1),
    "chunked": dict(prefill_token_budget=16),
    "merged": dict(merge="always", packed_prefill_prompts=1),
    "cpu-assist": dict(lora_mode="cpu-assist", emulated_link_gbps=0.001, cpu_workers=1),
    # The prompts served a second time, their blocks in the prefix cache: scored prompts
    # take no hit (every position computed).
    "prefix-cached": dict(packed_prefill_prompts=1),
    # No prompt scored (a scored prompt runs alone): the first tokens' from packed calls.
    "packed": dict(),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(jlora's load, PEFT's model over transformers', the adapter's directory)."""
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=16, rope_theta=5e5)  # fmt: skip
    return tiny_llama_with_adapter(tmp_path_factory, 0, rope_parameters=rope)


def _log_softmax(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def _serve(models, serving: str) -> tuple[list[list[int]], list, dict]:
    """The prompts, each one's events (of its last round) and the engine's counters."""
    loaded, _, adapter = models
    engine = make_engine(
        loaded, max_slots=4, max_seq_len=128, min_bucket=16, max_loras=1, max_lora_rank=8,
        **SERVING[serving],
    )  # fmt: skip
    engine.register_adapter("a", str(adapter))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY_HF["vocab_size"], n).tolist() for n in PROMPT_LENGTHS]
    scored = None if serving == "packed" else TOP
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=TOP, prompt_logprobs=scored)
    for round in range(2 if serving == "prefix-cached" else 1):
        for i, (prompt, name) in enumerate(zip(prompts, ROWS, strict=True)):
            engine.add_request(Request(f"r{round}-{i}", prompt, sampling, adapter=name))
        events: dict[str, list] = {f"r{round}-{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished:
            for event in engine.step():
                assert event.error is None, event.error
                events[event.request_id].append(event)
    counters = dict(engine.counters)
    engine.close()
    return prompts, list(events.values()), counters


@pytest.mark.parametrize("serving", sorted(SERVING))
def test_logprobs_are_the_models_log_softmax(models, serving):
    _, peft, _ = models
    prompts, served, counters = _serve(models, serving)
    if serving == "cpu-assist":
        assert counters["assisted_prefills"] >= 1
    if serving == "chunked":
        assert counters["prefill_chunks"] >= 1
    for prompt, events, adapter in zip(prompts, served, ROWS, strict=True):
        generated = [event.token_id for event in events]
        with peft.disable_adapter() if adapter is None else contextlib.nullcontext():
            expected = _log_softmax(peft, prompt + generated)
        assert events[0].cached_tokens == 0
        first = events[0].prompt_logprobs
        assert all(event.prompt_logprobs is None for event in events[1:])
        if serving == "packed":
            assert first is None
        else:
            assert first is not None and len(first) == len(prompt) - 1
            for j, entry in enumerate(first, start=1):  # token j, scored at position j - 1
                assert entry.token_id == prompt[j]
                _assert_position(entry, expected[j - 1])
        for k, event in enumerate(events):
            entry = event.logprobs
            assert entry is not None and entry.token_id == event.token_id
            _assert_position(entry, expected[len(prompt) - 1 + k])


def _assert_position(entry, expected: np.ndarray) -> None:
    """The entry's log-probability of its token, and its TOP most likely, are those of the
    log-softmax row `expected`."""
    np.testing.assert_allclose(entry.logprob, expected[entry.token_id], atol=1e-3)
    assert len(entry.top) == TOP
    values = np.array([value for _, value in entry.top])
    np.testing.assert_allclose(values, np.sort(expected)[::-1][:TOP], atol=1e-3)
    for token, value in entry.top:
        np.testing.assert_allclose(value, expected[token], atol=1e-3)


def test_a_request_without_logprobs_gets_none(models):
    loaded, _, _ = models
    engine = make_engine(loaded, max_slots=2, max_seq_len=64, min_bucket=16)
    engine.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=3)))
    events = [event for _ in range(20) for event in engine.step()][:3]
    engine.close()
    assert all(e.logprobs is None and e.prompt_logprobs is None for e in events)
