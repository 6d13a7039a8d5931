"""The sampling controls through the engine against transformers' `generate`, greedy.

A tiny random Llama (written by transformers) and a PEFT adapter. Requests with
repetition_penalty, min_tokens (with stop_token_ids), logit_bias, and OpenAI's presence
and frequency penalties (transformers has no processor for these: a torch one of
OpenAI's formula stands in) run in one batch with plain rows, through packed, chunked
and one-by-one prefills; each must give the greedy tokens `generate` gives with the
same control, and each control must change the text (the plain request's differ).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from jlora.engine.api import SamplingParams
from tests.engine_helpers import make_engine, run_to_completion
from tests.model_helpers import tiny_llama_with_adapter

pytestmark = pytest.mark.slow

NEW = 12
SERVING = {
    "packed": dict(),
    "one-by-one": dict(packed_prefill_prompts=1),
    "chunked": dict(prefill_token_budget=16),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(jlora's load, PEFT's model over transformers', the adapter's directory)."""
    return tiny_llama_with_adapter(tmp_path_factory, 1)


def _openai_penalties(presence: float, frequency: float, prompt: int):
    """OpenAI's presence and frequency penalties as a transformers logits processor."""
    import torch

    def process(input_ids, scores):
        output = input_ids[:, prompt:]
        counts = torch.zeros_like(scores).scatter_add_(
            1, output, torch.ones_like(output, dtype=scores.dtype)
        )
        return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)

    return process


def _generate(peft, adapter, prompt, **controls) -> list[int]:
    import torch
    from transformers import LogitsProcessorList

    controls = dict(controls)
    processors = LogitsProcessorList()
    if "openai" in controls:
        processors.append(_openai_penalties(*controls.pop("openai"), len(prompt)))
    with torch.no_grad(), peft.disable_adapter() if adapter is None else contextlib.nullcontext():
        out = peft.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW,
            do_sample=False,
            logits_processor=processors,
            pad_token_id=0,
            **controls,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def cases(models):
    """(prompt, adapter, jlora's SamplingParams, transformers' generate arguments): each
    control on a base and an adapter row, and the plain request beside them."""
    _, peft, _ = models
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 24, n).tolist() for n in (7, 30, 11, 19, 26)]
    plain = {
        (i, a): _generate(peft, a, p, eos_token_id=None)
        for i, p in enumerate(prompts)
        for a in (None, "a")
    }
    out = []
    for i, prompt in enumerate(prompts):
        for adapter in (None, "a"):
            first = plain[(i, adapter)]
            stop = first[1]  # plain greedy decoding would stop after two tokens (or one)
            out += [
                (prompt, adapter, SamplingParams(max_tokens=NEW), dict(eos_token_id=None)),
                (prompt, adapter, SamplingParams(max_tokens=NEW, repetition_penalty=1.8),
                 dict(eos_token_id=None, repetition_penalty=1.8)),
                (prompt, adapter, SamplingParams(max_tokens=NEW, stop_token_ids=(stop,)),
                 dict(eos_token_id=stop)),
                (prompt, adapter,
                 SamplingParams(max_tokens=NEW, stop_token_ids=(stop,), min_tokens=6),
                 dict(eos_token_id=stop, min_new_tokens=6)),
                (prompt, adapter,
                 SamplingParams(max_tokens=NEW, logit_bias=((first[3], -100.0), (5, 4.0))),
                 dict(eos_token_id=None, sequence_bias=[[[first[3]], -100.0], [[5], 4.0]])),
                (prompt, adapter,
                 SamplingParams(max_tokens=NEW, presence_penalty=2.0, frequency_penalty=2.0),
                 dict(eos_token_id=None, openai=(2.0, 2.0))),
            ]  # fmt: skip
    return out, plain


@pytest.mark.parametrize("serving", sorted(SERVING))
def test_controls_give_transformers_greedy_tokens(models, cases, serving):
    loaded, peft, adapter = models
    rows, plain = cases
    engine = make_engine(
        loaded, max_slots=8, max_seq_len=128, min_bucket=16, max_loras=1, max_lora_rank=8,
        **SERVING[serving],
    )  # fmt: skip
    engine.register_adapter("a", str(adapter))
    results = run_to_completion(
        engine, [p for p, *_ in rows], [s for _, _, s, _ in rows], [a for _, a, *_ in rows]
    )
    engine.close()
    for (prompt, name, sampling, controls), result in zip(rows, results, strict=True):
        assert result["token_ids"] == _generate(peft, name, prompt, **controls), sampling
    # Each control changes the text: against the plain request's, and min_tokens against
    # the same stop token without it (which stops after two tokens).
    tokens = [result["token_ids"] for result in results]
    changed = {control: 0 for control in range(1, 6)}
    for k in range(0, len(rows), 6):
        case = tokens[k : k + 6]
        assert case[0] == plain[(k // 12, rows[k][1])]
        assert len(case[2]) <= 2 and len(case[3]) > 6  # the stop token is the 1st or 2nd
        for control in (1, 2, 4, 5):
            changed[control] += case[control] != case[0]
        changed[3] += case[3][:6] != case[0][:6]
    assert all(count >= 6 for count in changed.values()), changed  # of 10 rows
