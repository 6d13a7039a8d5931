"""BGMV: the reference on hand-worked and naive-loop cases, then the Pallas kernel
against the reference over the adapter-mix sweep, compiled and in interpret mode."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.bgmv import batch_rank, bgmv, bgmv_reference, bgmv_shrink
from pallas_kernels.common import KernelArgumentError
from tests import kernel_cases
from tests.tolerances import assert_close

NAN = np.nan


def make_case(
    rng,
    ranks,
    rows,
    dtype,
    popularity="uniform",
    *,
    fan_in=64,
    fan_out=48,
    rank_dim=16,
    layers=2,
    base_every=4,
):
    """Kernel arguments for one adapter mix (without the layer) and its slot per row."""
    adapters = kernel_cases.make_adapters(rng, ranks, fan_in, fan_out, layers)
    a, b, slot_ranks = kernel_cases.stacked(adapters, rank_dim, dtype)
    slots = kernel_cases.row_slots(popularity, rows, len(ranks), rng, base_every)
    y, x = kernel_cases.activations(rng, rows, fan_in, fan_out, dtype)
    return adapters, slots, (y, x, a, b, jnp.asarray(slots), slot_ranks)


def test_reference_tiny_case():
    # Layer 1 of two (layer 0 is NaN), R = 2; slot 0 has rank 1, slot 1 rank 2.
    a = np.full((2, 2, 2, 2), NAN, np.float32)
    b = np.full((2, 2, 2, 2), NAN, np.float32)
    a[1, 0, 0], b[1, 0, 0] = [1, 2], [3, 4]  # rank row 1 of slot 0 stays NaN
    a[1, 1], b[1, 1] = [[1, 0], [0, 1]], [[1, 1], [2, -1]]
    x = np.array([[1, 1], [2, 3], [5, 5]], np.float32)
    y = np.array([[10, 20], [0, 0], [7, 7]], np.float32)
    idx = np.array([0, 1, -1], np.int32)
    ranks = np.array([1, 2], np.int32)
    # row 0: x @ A = [1*1 + 1*2] = [3];  3 * [3, 4] = [9, 12];  y = [19, 32]
    # row 1: x @ A = [2, 3];  2 * [1, 1] + 3 * [2, -1] = [8, -1];  y = [8, -1]
    # row 2: no adapter: [7, 7]
    out = bgmv_reference(*(jnp.asarray(v) for v in (y, x, a, b, idx, ranks)), 1)
    np.testing.assert_array_equal(np.asarray(out), [[19, 32], [8, -1], [7, 7]])


@pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
@pytest.mark.parametrize(
    "ranks, rank_dim", [(kernel_cases.MIXED_RANKS, 16), (kernel_cases.WIDE_RANKS, 64)]
)
def test_reference_matches_naive(ranks, rank_dim, dtype):
    rng = np.random.default_rng(1)
    adapters, slots, args = make_case(rng, ranks, 16, dtype, "uniform", rank_dim=rank_dim)
    expected = kernel_cases.naive(args[0], args[1], adapters, slots, 1, dtype)
    assert_close(bgmv_reference(*args, 1), expected, dtype, dtype, scope="op")


def test_a_shrink_writes_a_power_of_two_of_parts_per_row_at_least_its_in_blocks():
    from pallas_kernels.common import shrink_parts

    assert shrink_parts(4096, 512) == 8  # Llama-2-7B's attention: 8 blocks
    assert shrink_parts(576, 64) == 16  # SmolLM2: 9 blocks, 7 zero parts
    assert shrink_parts(11008, 256) == 64  # Llama-2-7B's down_proj: 43 blocks
    assert shrink_parts(64, 64) == 1


def test_batch_rank_is_the_largest_rank_in_use():
    ranks = jnp.array([16, 5, 64, 0], jnp.int32)
    assert int(batch_rank(jnp.array([1, -1, 0, 1], jnp.int32), ranks)[0]) == 16
    assert int(batch_rank(jnp.array([-1, 2], jnp.int32), ranks)[0]) == 64
    assert int(batch_rank(jnp.array([-1, -1], jnp.int32), ranks)[0]) == 0
    assert int(batch_rank(jnp.array([3, 1], jnp.int32), ranks)[0]) == 5


class TestBgmv:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _device(self):
        kernel_cases.gpu_or_skip(self.INTERPRET)

    def check(self, args, slots, layer, dtype):
        assert args[1].dtype == dtype
        kernel_cases.check_kernel(
            bgmv, bgmv_reference, (*args, layer), slots, interpret=self.INTERPRET
        )

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    @pytest.mark.parametrize("batch", kernel_cases.BATCHES)
    @pytest.mark.parametrize("popularity", kernel_cases.POPULARITY)
    def test_mixed_ranks(self, popularity, batch, dtype):
        rng = np.random.default_rng(batch)
        _, slots, args = make_case(rng, kernel_cases.MIXED_RANKS, batch, dtype, popularity)
        self.check(args, slots, 0, dtype)

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_wide_ranks(self, dtype):
        rng = np.random.default_rng(2)
        _, slots, args = make_case(rng, kernel_cases.WIDE_RANKS, 16, dtype, rank_dim=64)
        self.check(args, slots, 1, dtype)

    @pytest.mark.parametrize("layer", [2, jnp.int32(1)], ids=["int", "array"])
    def test_layer_above_zero(self, layer):
        rng = np.random.default_rng(3)
        _, slots, args = make_case(rng, kernel_cases.MIXED_RANKS, 7, "float32", layers=3)
        self.check(args, slots, layer, "float32")

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_all_rows_without_adapter(self, dtype):
        rng = np.random.default_rng(4)
        _, _, args = make_case(rng, kernel_cases.MIXED_RANKS, 7, dtype)
        slots = np.full(7, -1, np.int32)
        args = (*args[:4], jnp.asarray(slots), args[5])
        out = bgmv(*args, 1, interpret=self.INTERPRET)
        assert out.dtype == args[0].dtype
        kernel_cases.assert_untouched(args[0], out, slots)

    @pytest.mark.parametrize("ranks", [(0, 5, 0, 16), (0, 0)], ids=["mixed", "only-zero"])
    def test_rank_zero_slots(self, ranks):
        rng = np.random.default_rng(5)
        _, slots, args = make_case(rng, ranks, 16, "float32", "distinct")
        self.check(args, slots, 1, "float32")

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_shrink_alone_and_split_on_the_rank(self, dtype):
        """The first half alone is x @ A (zero past each rank); two devices each holding
        half the rank rows, with ranks clipped to their half, give its two halves."""
        rng = np.random.default_rng(8)
        adapters, slots, (_, x, a, _, idx, ranks) = make_case(
            rng, kernel_cases.WIDE_RANKS, 16, dtype, rank_dim=64
        )
        v = bgmv_shrink(x, a, idx, ranks, 1, interpret=self.INTERPRET)
        expected = kernel_cases.naive_shrink(x, adapters, slots, 1, dtype, 64)
        assert_close(v, expected, dtype, "float32", scope="op")
        parts = [
            bgmv_shrink(
                x,
                a[:, :, k * 32 : (k + 1) * 32],
                idx,
                jnp.clip(ranks - k * 32, 0, 32),
                1,
                interpret=self.INTERPRET,
            )  # fmt: skip
            for k in range(2)
        ]
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), np.asarray(v))

    def test_smollm2_shape(self):
        rng = np.random.default_rng(6)
        _, slots, args = make_case(
            rng, kernel_cases.MIXED_RANKS, 16, "bfloat16", "zipf", fan_in=576, fan_out=192
        )
        self.check(args, slots, 1, "bfloat16")


class TestBgmvInterpret(TestBgmv):
    INTERPRET = True


class TestLowering:
    """The compiled kernels lower to Triton for CUDA at Llama-2-7B shapes (on any host)."""

    @pytest.mark.parametrize("fan_in, fan_out", [(4096, 4096), (4096, 11008), (11008, 4096)])
    def test_triton_lowering(self, fan_in, fan_out):
        rows, layers, slots, rank_dim = 32, 2, 4, 64
        bf16, i32 = jnp.bfloat16, jnp.int32
        shapes = [
            ((rows, fan_out), bf16),  # y
            ((rows, fan_in), bf16),  # x
            ((layers, slots, rank_dim, fan_in), bf16),  # a
            ((layers, slots, rank_dim, fan_out), bf16),  # b
            ((rows,), i32),  # idx
            ((slots,), i32),  # ranks
            ((), i32),  # layer
        ]
        assert kernel_cases.triton_calls(bgmv, shapes) == 2  # shrink and expand


ARG_NAMES = ("y", "x", "a", "b", "idx", "ranks")


def _spoiled(**changes):
    """Valid small arguments with some of them changed (by name)."""

    def build():
        valid = make_case(np.random.default_rng(7), (4, 8), 3, "float32", rank_dim=8)[2]
        return [changes.get(name, lambda v: v)(v) for name, v in zip(ARG_NAMES, valid, strict=True)]

    return build


BAD_ARGS = {  # case: (the argument the error names, its arguments)
    "x-dtype": ("x", _spoiled(x=lambda x: x.astype(jnp.float16))),
    "y-dtype": ("y", _spoiled(y=lambda y: y.astype(jnp.bfloat16))),
    "y-rows": ("y", _spoiled(y=lambda y: y[:2])),
    "a-dtype": ("a", _spoiled(a=lambda a: a.astype(jnp.bfloat16))),
    "a-in": ("a", _spoiled(a=lambda a: a[..., :32])),
    "b-out": ("b", _spoiled(b=lambda b: b[..., :40])),
    "b-slots": ("b", _spoiled(b=lambda b: b[:, :1])),
    "rank-not-pow2": ("a", _spoiled(a=lambda a: a[:, :, :6], b=lambda b: b[:, :, :6])),
    "idx-dtype": ("idx", _spoiled(idx=lambda idx: idx.astype(jnp.int16))),
    "idx-rows": ("idx", _spoiled(idx=lambda idx: idx[:2])),
    "ranks-dtype": ("ranks", _spoiled(ranks=lambda ranks: ranks.astype(jnp.float32))),
    "ranks-slots": ("ranks", _spoiled(ranks=lambda ranks: ranks[:1])),
}


@pytest.mark.parametrize("case", BAD_ARGS)
@pytest.mark.parametrize(
    "fn",
    [lambda *a: bgmv(*a, 0, interpret=True), lambda *a: bgmv_reference(*a, 0)],
    ids=["kernel", "reference"],
)
def test_argument_errors_name_the_argument(fn, case):
    name, build = BAD_ARGS[case]
    with pytest.raises(KernelArgumentError, match=rf"^{name} "):
        fn(*build())
