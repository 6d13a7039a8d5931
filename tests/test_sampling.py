"""Per-row sampling: greedy, temperature, top-k, top-p and seeds, on hand-made logits; the
rows' log-probabilities against torch's log-softmax and top-k."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jlora.device.sampling import SamplingArrays, host_sampling, sample

sample_jit = jax.jit(lambda logits, params: sample(logits, params)[0])
logprobs_jit = jax.jit(lambda logits, params: sample(logits, params)[1])

# Four tokens with softmax probabilities 0.5, 0.25, 0.125, 0.125 (log-probabilities).
LOGITS = np.log(np.array([0.5, 0.25, 0.125, 0.125], np.float32))


def _arrays(
    rows, temperature=1.0, top_k=0, top_p=1.0, seed=0, step=None, logprobs=False, min_p=0.0
) -> SamplingArrays:
    full = lambda value, dtype: np.full(rows, value, dtype)  # noqa: E731
    return host_sampling(rows, 0, 4096).replace(
        temperature=full(temperature, np.float32),
        top_k=full(top_k, np.int32),
        top_p=full(top_p, np.float32),
        seed=full(seed, np.uint32),
        step=np.arange(rows, dtype=np.int32) if step is None else full(step, np.int32),
        logprobs=np.asarray(logprobs) if np.ndim(logprobs) else full(logprobs, bool),
        min_p=full(min_p, np.float32),
    )


def _draws(rows=4000, **kwargs) -> np.ndarray:
    """One draw per row; rows differ only in their step, so these are independent samples."""
    return np.asarray(sample_jit(np.tile(LOGITS, (rows, 1)), _arrays(rows, **kwargs)))


def test_greedy_is_argmax_per_row():
    logits = np.random.default_rng(0).normal(size=(5, 50)).astype(np.float32)
    tokens = sample_jit(logits, _arrays(5, temperature=0.0))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_temperature_one_follows_the_softmax():
    freq = np.bincount(_draws(), minlength=4) / 4000
    # Binomial std at p=0.5 and n=4000 is 0.008; 4 std is a bound no correct sampler crosses.
    np.testing.assert_allclose(freq, [0.5, 0.25, 0.125, 0.125], atol=0.032)


@pytest.mark.parametrize(
    "kwargs, support",
    [
        ({"top_k": 1}, {0}),
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.4}, {0}),  # the first token alone already holds 0.5 >= 0.4
        ({"top_p": 0.7}, {0, 1}),  # 0.5 < 0.7, then 0.75 >= 0.7
        ({"top_k": 2, "top_p": 0.99}, {0, 1}),
        ({"top_k": 3}, {0, 1, 2, 3}),  # a tie with the k-th is kept (transformers', vLLM's)
        ({"temperature": 1e-4}, {0}),
    ],
)
def test_cuts_restrict_the_support(kwargs, support):
    assert set(_draws(rows=2000, **kwargs).tolist()) == support


def test_top_k_renormalises():
    freq = np.bincount(_draws(top_k=2), minlength=4) / 4000
    np.testing.assert_allclose(freq, [2 / 3, 1 / 3, 0, 0], atol=0.03)


@pytest.mark.parametrize("top_p", [1.0, 0.87], ids=["no-cut", "nucleus"])
def test_a_draw_over_a_whole_vocabulary_follows_its_softmax(top_p):
    """3000 tokens (past the candidates, in blocks of the draw's inversion): five heavy
    tokens in different blocks hold 0.9, the rest share 0.1; with top_p 0.87 only the
    five are kept (renormalised)."""
    vocab, rows = 3000, 4000
    heavy, weights = [10, 700, 1500, 2222, 2999], np.array([0.3, 0.25, 0.2, 0.1, 0.05])
    probs = np.full(vocab, 0.1 / (vocab - 5))
    probs[heavy] = weights
    logits = np.tile(np.log(probs).astype(np.float32), (rows, 1))
    drawn = np.asarray(sample_jit(logits, _arrays(rows, top_p=top_p)))
    expected = weights if top_p == 1.0 else weights / weights.sum()
    freq = np.array([(drawn == token).mean() for token in heavy])
    np.testing.assert_allclose(freq, expected, atol=4 * np.sqrt(0.25 / rows))
    tail = 1 - np.isin(drawn, heavy).mean()
    assert abs(tail - (0.1 if top_p == 1.0 else 0.0)) < 4 * np.sqrt(0.09 / rows)


def test_seed_and_step_determine_the_sample_not_the_batch():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 1000)).astype(np.float32)
    arrays = _arrays(6, seed=7, step=3)
    rows = [jax.tree.map(lambda a, i=i: a[i : i + 1], arrays) for i in range(6)]
    alone = [int(sample_jit(logits[i : i + 1], row)[0]) for i, row in enumerate(rows)]
    np.testing.assert_array_equal(sample_jit(logits, arrays), alone)
    other_seeds = [int(sample_jit(logits[:1], _arrays(1, seed=s, step=3))[0]) for s in range(20)]
    assert len(set(other_seeds)) > 1


def test_greedy_rows_stay_greedy_in_a_sampled_batch():
    logits = np.random.default_rng(2).normal(size=(4, 100)).astype(np.float32)
    arrays = _arrays(4)
    arrays.temperature[[0, 2]] = 0.0
    tokens = np.asarray(sample_jit(logits, arrays))
    np.testing.assert_array_equal(tokens[[0, 2]], logits[[0, 2]].argmax(-1))


def test_a_rows_logprobs_are_torchs_log_softmax_of_the_raw_logits():
    """Of the token sampled (at temperature 2: before the temperature) and the 20 most
    likely, for the rows that ask; a batch where none asks returns zeros."""
    import torch

    logits = np.random.default_rng(1).normal(size=(3, 300)).astype(np.float32) * 3
    wanted = np.array([True, False, True])
    params = _arrays(3, temperature=2.0, logprobs=wanted)
    tokens = np.asarray(sample_jit(logits, params))
    ours = jax.tree.map(np.asarray, logprobs_jit(logits, params))
    theirs = torch.log_softmax(torch.tensor(logits), dim=-1)
    top, top_ids = torch.topk(theirs, 20, dim=-1)
    for row in np.flatnonzero(wanted):
        np.testing.assert_allclose(ours.chosen[row], theirs[row, tokens[row]], rtol=1e-6)
        np.testing.assert_array_equal(ours.top_ids[row], top_ids[row].numpy())
        np.testing.assert_allclose(ours.top[row], top[row].numpy(), rtol=1e-6)
    none = jax.tree.map(np.asarray, logprobs_jit(logits, _arrays(3, logprobs=False)))
    assert not none.chosen.any() and not none.top.any()
