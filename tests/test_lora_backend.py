"""The reference LoRA backend against a naive loop, on the device slot layout.

The loop is the semantics written out (backend.py): for each row, if its slot is not
-1, y += x @ A[layer, slot] @ B[layer, slot], in fp32 and one row at a time.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jlora.adapters.backend import ReferenceBackend, Segments
from tests.tolerances import assert_close

SHAPES = {"q_proj": (24, 40), "down_proj": (56, 24)}
LAYERS, SLOTS, MAX_RANK = 3, 4, 16
RANKS = (16, 5, 1, 8)  # slot i holds an adapter of rank RANKS[i]; 5 is not a power of two


def _adapter(rng, rank, targets=SHAPES):
    """Scaled like a trained adapter: x @ A and x @ A @ B have entries of size ~1."""
    return {
        target: (
            (rng.standard_normal((LAYERS, fan_in, rank)) / np.sqrt(fan_in)).astype(np.float32),
            (rng.standard_normal((LAYERS, rank, fan_out)) / np.sqrt(rank)).astype(np.float32),
        )
        for target, (fan_in, fan_out) in SHAPES.items()
        if target in targets
    }


@pytest.fixture(scope="module")
def slots():
    """Device slots holding four adapters (slot 2 adapts only q_proj), and their tensors."""
    backend, rng = ReferenceBackend(), np.random.default_rng(0)
    adapters = [
        _adapter(rng, rank, targets=("q_proj",) if i == 2 else SHAPES)
        for i, rank in enumerate(RANKS)
    ]
    weights = {}
    for dtype in ("float32", "bfloat16"):
        w = backend.allocate(
            num_layers=LAYERS, num_slots=SLOTS, max_rank=MAX_RANK, shapes=SHAPES, dtype=dtype
        )
        for slot, tensors in enumerate(adapters):
            payload = backend.pack(tensors, shapes=SHAPES, max_rank=MAX_RANK, dtype=dtype)
            w = backend.install(w, jnp.int32(slot), payload)
        weights[dtype] = w
    return backend, weights, adapters


def _naive(adapters, target, layer, x, row_slots, dtype="float32"):
    """fp32, one row at a time, on the weights as stored in `dtype`."""
    fan_out = next(adapter[target][1].shape[-1] for adapter in adapters if target in adapter)
    out = np.zeros((x.shape[0], fan_out), np.float32)
    for row, slot in enumerate(row_slots):
        if slot >= 0 and target in adapters[slot]:
            a, b = (_stored(w[layer], dtype) for w in adapters[slot][target])
            out[row] = (x[row].astype(np.float32) @ a) @ b
    return out


def _stored(array, dtype):
    return np.asarray(jnp.asarray(array, dtype), np.float32)


def test_naive_loop_by_hand():
    # One row, rank 1: x = [1, 2], A = [[3], [4]] -> x @ A = 11; B = [[5, 6]] -> [55, 66].
    adapters = [{"t": (np.array([[[3.0], [4.0]]]), np.array([[[5.0, 6.0]]]))}]
    x = np.array([[1.0, 2.0], [7.0, 7.0]], np.float32)
    out = _naive(adapters, "t", 0, x, [0, -1])  # the second row has no adapter
    np.testing.assert_array_equal(out, [[55.0, 66.0], [0.0, 0.0]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("target", sorted(SHAPES))
@pytest.mark.parametrize(
    "row_slots",
    [[0], [-1], [3, 3, 3], [0, 1, 2, 3], [2, -1, 0, -1, 1, 1, 3], [-1, -1, -1]],
    ids=["one", "none", "identical", "distinct", "mixed", "all-base"],
)
def test_bgmv_matches_the_loop(slots, dtype, target, row_slots):
    backend, weights, adapters = slots
    rng = np.random.default_rng(len(row_slots))
    x = rng.standard_normal((len(row_slots), SHAPES[target][0])).astype(np.float32)
    for layer in range(LAYERS):
        delta = backend.bgmv(
            weights[dtype], target, jnp.int32(layer), jnp.asarray(x, dtype), jnp.array(row_slots)
        )
        expected = _naive(adapters, target, layer, _stored(x, dtype), row_slots, dtype)
        assert_close(delta, expected, dtype, dtype, scope="op")
        base_rows = np.array(row_slots) < 0
        assert not np.asarray(delta, np.float32)[base_rows].any(), "a -1 row got a delta"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "segment_slots, starts",
    [([1], [0, 9]), ([-1], [0, 9]), ([2, -1, 0], [0, 3, 4, 7]), ([3, 1], [0, 0, 5])],
    ids=["one", "none", "mixed-with-padding", "empty-segment"],
)
def test_sgmv_matches_the_loop(slots, dtype, segment_slots, starts):
    backend, weights, adapters = slots
    rows = 9
    row_slots = [-1] * rows
    for slot, begin, end in zip(segment_slots, starts, starts[1:], strict=False):
        row_slots[begin:end] = [slot] * (end - begin)
    segments = Segments(slot=jnp.array(segment_slots), start=jnp.array(starts))
    x = np.random.default_rng(1).standard_normal((rows, SHAPES["q_proj"][0])).astype(np.float32)
    delta = backend.sgmv(weights[dtype], "q_proj", jnp.int32(1), jnp.asarray(x, dtype), segments)
    expected = _naive(adapters, "q_proj", 1, _stored(x, dtype), row_slots, dtype)
    assert_close(delta, expected, dtype, dtype, scope="op")


def test_installing_a_slot_leaves_the_others_untouched(slots):
    backend, weights, adapters = slots
    rng = np.random.default_rng(7)
    replacement = _adapter(rng, 3)
    payload = backend.pack(replacement, shapes=SHAPES, max_rank=MAX_RANK, dtype="float32")
    updated = backend.install(weights["float32"], jnp.int32(1), payload)
    for target in SHAPES:
        for part in ("a", "b"):
            before, after = weights["float32"][target][part], updated[target][part]
            np.testing.assert_array_equal(np.delete(after, 1, axis=1), np.delete(before, 1, axis=1))
        np.testing.assert_array_equal(updated[target]["a"][:, 1, :, :3], replacement[target][0])
        assert not np.asarray(updated[target]["a"][:, 1, :, 3:]).any(), "rank padding not zero"
