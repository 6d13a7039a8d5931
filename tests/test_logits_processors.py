"""The sampler's logit adjustments against transformers' logits processors, row by row.

Each control on random logits: repetition_penalty (RepetitionPenaltyLogitsProcessor over
the row's prompt and output), min_tokens (MinNewTokensLengthLogitsProcessor), logit_bias
(SequenceBiasLogitsProcessor of one-token sequences) and min_p (MinPLogitsWarper after
TemperatureLogitsWarper: the tokens a draw can reach); presence and frequency penalties,
which transformers does not have, against OpenAI's formula in numpy. A batch mixing
every control gives each row what it gives alone, and no value recompiles the step.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jlora.device.sampling import (
    CANDIDATES,
    PAD,
    SamplingArrays,
    adjust,
    host_sampling,
    kept,
    sample,
    set_sampling,
)
from jlora.engine.device_api import SamplingRow

VOCAB = 64
HISTORY = 24
adjust_jit = jax.jit(adjust)
kept_jit = jax.jit(kept)
sample_jit = jax.jit(lambda logits, params: sample(logits, params)[0])


def _logits(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, (rows, VOCAB)).astype(np.float32)


def _rows(rows: list[SamplingRow], histories: list[list[int]]) -> SamplingArrays:
    arrays = host_sampling(len(rows), HISTORY, VOCAB)
    for i, (row, history) in enumerate(zip(rows, histories, strict=True)):
        set_sampling(arrays, i, row, history)
    return arrays


def _row(step: int = 0, **controls) -> SamplingRow:
    return SamplingRow(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=step, **controls)


def _history(seed: int, prompt: int, output: int) -> list[int]:
    """A prompt and output drawn from a small part of the vocabulary, so tokens repeat."""
    return np.random.default_rng(seed).integers(0, 12, prompt + output).tolist()


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_is_transformers(penalty):
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = _logits(3)
    histories = [_history(1, 5, 0), _history(2, 9, 4), _history(3, 1, 12)]
    rows = [_row(step=s, repetition=penalty) for s in (0, 4, 12)]
    ours = np.asarray(adjust_jit(logits, _rows(rows, histories)))
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for i, history in enumerate(histories):
        theirs = processor(torch.tensor([history]), torch.tensor(logits[i : i + 1]))[0]
        np.testing.assert_allclose(ours[i], theirs.numpy(), rtol=1e-6)
    assert not np.allclose(ours, logits)


def test_min_tokens_bans_the_stop_tokens_as_transformers():
    import torch
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    logits = _logits(4, seed=1)
    stops = [3, 17, 40]
    prompt = 6
    histories = [_history(i, prompt, step) for i, step in enumerate((0, 2, 3, 5))]
    rows = [_row(step=step, min_tokens=3, banned=tuple(stops)) for step in (0, 2, 3, 5)]
    ours = np.asarray(adjust_jit(logits, _rows(rows, histories)))
    processor = MinNewTokensLengthLogitsProcessor(prompt, 3, stops)
    for i, history in enumerate(histories):
        theirs = processor(torch.tensor([history]), torch.tensor(logits[i : i + 1]))[0]
        np.testing.assert_array_equal(ours[i], theirs.numpy())
    assert np.isneginf(ours[:2, stops]).all() and np.isfinite(ours[2:, stops]).all()


def test_logit_bias_is_transformers_sequence_bias():
    import torch
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    logits = _logits(2, seed=2)
    biases = [((5, 100.0), (9, -30.5), (63, 2.25)), ((1, -100.0),)]
    rows = [_row(logit_bias=bias) for bias in biases]
    ours = np.asarray(adjust_jit(logits, _rows(rows, [[], []])))
    for i, bias in enumerate(biases):
        processor = SequenceBiasLogitsProcessor([[[token], value] for token, value in bias])
        theirs = processor(torch.tensor([[1, 2]]), torch.tensor(logits[i : i + 1]))[0]
        np.testing.assert_allclose(ours[i], theirs.numpy(), rtol=1e-6)
    assert int(ours[0].argmax()) == 5  # a bias of 100 decides a greedy row


def test_presence_and_frequency_penalties_are_openais_over_the_output():
    logits = _logits(3, seed=3)
    histories = [_history(4, 6, 0), _history(5, 3, 10), _history(6, 8, 7)]
    controls = [dict(presence=0.5, frequency=0.0), dict(presence=-1.0, frequency=0.75),
                dict(presence=2.0, frequency=-2.0)]  # fmt: skip
    rows = [_row(step=s, **c) for s, c in zip((0, 10, 7), controls, strict=True)]
    ours = np.asarray(adjust_jit(logits, _rows(rows, histories)))
    for i, (history, c) in enumerate(zip(histories, controls, strict=True)):
        output = history[len(history) - rows[i].step :] if rows[i].step else []
        counts = np.bincount(output, minlength=VOCAB).astype(np.float32)
        expected = logits[i] - c["frequency"] * counts - c["presence"] * (counts > 0)
        np.testing.assert_allclose(ours[i], expected, rtol=1e-6, atol=1e-6)
    assert np.array_equal(ours[0], logits[0])  # no output yet: nothing to penalise


@pytest.mark.parametrize("min_p, temperature", [(0.1, 1.0), (0.3, 0.7), (0.02, 1.5)])
def test_min_p_keeps_the_tokens_transformers_keeps(min_p, temperature):
    import torch
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    logits = np.tile(_logits(1, seed=4) / 2, (3000, 1))
    arrays = host_sampling(3000, 0, VOCAB).replace(
        temperature=np.full(3000, temperature, np.float32),
        min_p=np.full(3000, min_p, np.float32),
        step=np.arange(3000, dtype=np.int32),
    )
    drawn = set(np.asarray(sample_jit(logits, arrays)).tolist())
    scores = TemperatureLogitsWarper(temperature)(None, torch.tensor(logits[:1]))
    kept = MinPLogitsWarper(min_p)(None, scores)[0]
    reachable = set(np.flatnonzero(torch.isfinite(kept).numpy()).tolist())
    probs = torch.softmax(kept, -1).numpy()
    likely = {t for t in reachable if probs[t] > 0.01}  # each drawn in 3000 with p > 0.9999
    assert likely <= drawn <= reachable
    assert len(reachable) < VOCAB


CUTS = [  # temperature, top_k, top_p, min_p
    (1.0, 5, 1.0, 0.0),
    (0.7, 40, 0.8, 0.0),
    (1.0, 0, 0.9, 0.0),
    (2.5, 0, 0.995, 0.0),  # a wide nucleus: past the candidates
    (1.0, 0, 1.0, 0.0),  # no cut: every token
    (1.0, 600, 1.0, 0.0),  # top-k past the candidates
    (1.3, 700, 0.97, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.5, 20, 1.0, 0.2),
]


@pytest.mark.parametrize("peaked", [True, False], ids=["peaked", "flat"])
def test_the_cuts_keep_the_tokens_transformers_warpers_keep(peaked):
    """Temperature, top-k, top-p and min-p on a 1000-token vocabulary (beyond the
    candidates the cuts are first looked for among), each row against transformers'
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper in
    that order (min-p and top-p never together: vLLM applies min-p first, transformers
    last)."""
    import torch
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    vocab = 1000
    assert vocab > 2 * CANDIDATES
    rng = np.random.default_rng(7 if peaked else 8)
    scale = 4.0 if peaked else 0.5
    logits = rng.normal(0.0, scale, (len(CUTS), vocab)).astype(np.float32)
    arrays = host_sampling(len(CUTS), 0, 1000)
    for i, (temperature, top_k, top_p, min_p) in enumerate(CUTS):
        arrays.temperature[i], arrays.top_k[i] = temperature, top_k
        arrays.top_p[i], arrays.min_p[i] = top_p, min_p
    ours = np.asarray(kept_jit(logits, arrays))
    for i, (temperature, top_k, top_p, min_p) in enumerate(CUTS):
        scores = torch.tensor(logits[i : i + 1], dtype=torch.float64)
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        if min_p:
            scores = MinPLogitsWarper(min_p)(None, scores)
        theirs = torch.isfinite(scores[0]).numpy()
        np.testing.assert_array_equal(ours[i], theirs, err_msg=str(CUTS[i]))
    counts = ours.sum(-1)
    assert counts[4] == vocab and counts[5] == 600 and counts[3] > CANDIDATES
    assert counts[2] < CANDIDATES or not peaked  # found among the candidates


def test_rows_are_independent_and_no_value_recompiles():
    """A batch of five rows, each with other controls, gives each row's adjusted logits
    and greedy token of that row alone; new values reuse the compiled step."""
    logits = _logits(5, seed=5)
    histories = [_history(10 + i, 4, 3) for i in range(5)]
    rows = [
        _row(step=3),
        _row(step=3, repetition=1.5),
        _row(step=3, presence=1.0, frequency=0.5),
        _row(step=3, min_tokens=5, banned=(int(logits[3].argmax()),)),
        _row(step=3, logit_bias=((7, 50.0),)),
    ]
    batch = _rows(rows, histories)
    together = np.asarray(adjust_jit(logits, batch))
    greedy = np.asarray(sample_jit(logits, batch))
    compiled = sample_jit._cache_size()
    for i in range(5):
        alone = _rows([rows[i]], [histories[i]])
        ours = np.asarray(adjust_jit(logits[i : i + 1], alone))[0]
        np.testing.assert_array_equal(together[i], ours)
        copies = _rows([rows[i]] * 5, [histories[i]] * 5)
        assert int(np.asarray(sample_jit(np.tile(logits[i], (5, 1)), copies))[0]) == greedy[i]
    assert greedy[3] != logits[3].argmax() and greedy[4] == 7
    assert sample_jit._cache_size() == compiled
    assert batch.history[1, :7].tolist() == histories[1] and (batch.history[1, 7:] == PAD).all()
