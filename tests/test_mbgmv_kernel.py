"""MBGMV: the reference on hand-computed cases and against the naive loop, then the kernel
against the reference over the adapter-mix sweep, its GPU lowering, and argument errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.mbgmv import mbgmv, mbgmv_reference, mbgmv_shrink
from tests import kernel_cases
from tests.tolerances import assert_close

NAN = np.nan
FAN_IN, FAN_OUT, LAYERS = 64, 48, 2


def _tiny_f32():
    """Two slots in a 4-page pool (layer 0 all NaN, layer 1 used), three rows.

    Slot 0 (rank 2, pages 3, 0), row 0, x = [1, 1]:
      v = [x . a3, x . a0] = [1*3 + 1*0, 1*1 + 1*2] = [3, 3]
      y += 3 * b3 + 3 * b0 = [3, 3] + [3, 0] -> [10, 20] + [6, 3] = [16, 23]
    Slot 1 (rank 1, pages 1, 2), row 1, x = [2, 1]: page 2 is past the rank (NaN, ignored)
      v = [x . a1] = [2*0 + 1*1] = [1];  y += 1 * b1 = [0, 2] -> [30, 42]
    Row 2 has no adapter: [50, 60] stays.
    """
    a_pool = np.full((2, 4, 2), NAN, np.float32)
    b_pool = np.full((2, 4, 2), NAN, np.float32)
    a_pool[1, [0, 1, 3]] = [[1, 2], [0, 1], [3, 0]]
    b_pool[1, [0, 1, 3]] = [[1, 0], [0, 2], [1, 1]]
    args = (
        jnp.array([[10, 20], [30, 40], [50, 60]], jnp.float32),  # y
        jnp.array([[1, 1], [2, 1], [5, 5]], jnp.float32),  # x
        jnp.asarray(a_pool),
        jnp.asarray(b_pool),
        jnp.array([0, 1, -1], jnp.int32),  # idx
        jnp.array([[3, 0], [1, 2]], jnp.int32),  # pages
        jnp.array([2, 1], jnp.int32),  # ranks
        1,  # layer
    )
    return args, np.array([[16, 23], [30, 42], [50, 60]], np.float32)


def _tiny_bf16():
    """v is rounded to bf16 before @ B. One rank-1 slot, x = [1, 1], a = [1, 3 * 2^-9]:
    x . a = 1.005859375 in fp32, 1 + 0.75 * 2^-7, which rounds to 1 + 2^-7 = 1.0078125.
    y = -256 + 1.0078125 * 256 = 2 (without the rounding it would be 1.5, exact in bf16).
    """
    args = (
        jnp.array([[-256]], jnp.bfloat16),  # y
        jnp.array([[1, 1]], jnp.bfloat16),  # x
        jnp.array([[[1, 3 * 2.0**-9]]], jnp.bfloat16),  # a_pool
        jnp.array([[[256]]], jnp.bfloat16),  # b_pool
        jnp.array([0], jnp.int32),  # idx
        jnp.array([[0]], jnp.int32),  # pages
        jnp.array([1], jnp.int32),  # ranks
        0,  # layer
    )
    return args, np.array([[2]], np.float32)


TINY = {"f32": _tiny_f32, "bf16": _tiny_bf16}


def _paged_case(seed, ranks, rank_dim, batch, popularity, dtype, fan_in=FAN_IN, fan_out=FAN_OUT):
    """(mbgmv args, adapters, row slots) for a mix of adapters laid out by kernel_cases.paged."""
    rng = np.random.default_rng(seed)
    adapters = kernel_cases.make_adapters(rng, ranks, fan_in, fan_out, LAYERS)
    a_pool, b_pool, pages, slot_ranks = kernel_cases.paged(adapters, rank_dim, rng, dtype)
    slots = kernel_cases.row_slots(popularity, batch, len(ranks), rng)
    y, x = kernel_cases.activations(rng, batch, fan_in, fan_out, dtype)
    args = (y, x, a_pool, b_pool, jnp.asarray(slots), pages, slot_ranks, LAYERS - 1)
    return args, adapters, slots


@pytest.mark.parametrize("name", TINY)
def test_reference_tiny(name):
    args, expected = TINY[name]()
    out = mbgmv_reference(*args)
    assert out.dtype == args[0].dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)


@pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
@pytest.mark.parametrize("popularity, batch", [("uniform", 7), ("zipf", 16), ("distinct", 3)])
def test_reference_matches_naive(popularity, batch, dtype):
    args, adapters, slots = _paged_case(1, kernel_cases.MIXED_RANKS, 16, batch, popularity, dtype)
    expected = kernel_cases.naive(args[0], args[1], adapters, slots, LAYERS - 1, dtype)
    assert_close(mbgmv_reference(*args), expected, dtype, dtype, scope="op")
    kernel_cases.assert_untouched(args[0], mbgmv_reference(*args), slots)


class TestMbgmv:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _device(self):
        kernel_cases.gpu_or_skip(self.INTERPRET)

    def _check(self, args, slots):
        return kernel_cases.check_kernel(
            mbgmv, mbgmv_reference, args, slots, interpret=self.INTERPRET
        )

    @pytest.mark.parametrize("name", TINY)
    def test_tiny(self, name):
        args, expected = TINY[name]()
        out = self._check(args, np.asarray(args[4]))
        np.testing.assert_array_equal(np.asarray(out, np.float32), expected)

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    @pytest.mark.parametrize("batch", kernel_cases.BATCHES)
    @pytest.mark.parametrize("popularity", kernel_cases.POPULARITY)
    def test_mixed_ranks(self, popularity, batch, dtype):
        args, _, slots = _paged_case(2, kernel_cases.MIXED_RANKS, 16, batch, popularity, dtype)
        self._check(args, slots)

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    @pytest.mark.parametrize("popularity", ["uniform", "skewed"])
    def test_wide_ranks(self, popularity, dtype):
        args, _, slots = _paged_case(3, kernel_cases.WIDE_RANKS, 64, 16, popularity, dtype)
        self._check(args, slots)

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_shrink_alone(self, dtype):
        args, adapters, slots = _paged_case(4, kernel_cases.WIDE_RANKS, 64, 16, "uniform", dtype)
        _, x, a_pool, _, idx, pages, ranks, layer = args
        v = mbgmv_shrink(x, a_pool, idx, pages, ranks, layer, interpret=self.INTERPRET)
        expected = kernel_cases.naive_shrink(x, adapters, slots, layer, dtype, 64)
        assert_close(v, expected, dtype, "float32", scope="op")

    def test_rank_zero_slots_add_nothing(self):
        args, _, slots = _paged_case(4, (0, 5, 16, 0), 16, 16, "distinct", "float32")
        out = self._check(args, slots)
        rank_zero_rows = np.isin(slots, [0, 3])
        assert rank_zero_rows.any()
        np.testing.assert_array_equal(
            np.asarray(out)[rank_zero_rows], np.asarray(args[0])[rank_zero_rows]
        )

    def test_all_rows_without_adapter(self):
        args, _, _ = _paged_case(5, kernel_cases.MIXED_RANKS, 16, 7, "uniform", "bfloat16")
        slots = np.full(7, -1, np.int32)
        self._check((*args[:4], jnp.asarray(slots), *args[5:]), slots)

    @pytest.mark.parametrize("layer", [0, 1])
    def test_each_layer(self, layer):
        args, adapters, slots = _paged_case(6, kernel_cases.MIXED_RANKS, 16, 7, "zipf", "float32")
        args = (*args[:7], layer)
        out = self._check(args, slots)
        expected = kernel_cases.naive(args[0], args[1], adapters, slots, layer, "float32")
        assert_close(out, expected, "float32", "float32", scope="op")

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_smollm2_shape(self, dtype):
        """SmolLM2-135M's k/v projection, 576 -> 192: several `in` blocks and `out` tiles."""
        args, _, slots = _paged_case(
            7, kernel_cases.MIXED_RANKS, 16, 16, "uniform", dtype, 576, 192
        )
        self._check(args, slots)

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_stacked_and_paged_layouts_agree(self, dtype):
        """The same adapters, stacked ([L, N, R, in] as a pool) or scattered through a pool."""
        paged_args, adapters, slots = _paged_case(
            8, kernel_cases.MIXED_RANKS, 16, 16, "uniform", dtype
        )
        a, b, ranks = kernel_cases.stacked(adapters, 16, dtype)
        stacked_pool = (a.reshape(LAYERS, -1, FAN_IN), b.reshape(LAYERS, -1, FAN_OUT))
        stacked_pages = common.stacked_pages(len(adapters), 16)
        stacked_args = (
            *paged_args[:2],
            *stacked_pool,
            paged_args[4],
            stacked_pages,
            ranks,
            LAYERS - 1,
        )
        from_stacked = self._check(stacked_args, slots)
        from_paged = self._check(paged_args, slots)
        np.testing.assert_array_equal(np.asarray(from_stacked), np.asarray(from_paged))
        np.testing.assert_array_equal(
            np.asarray(mbgmv_reference(*stacked_args)), np.asarray(mbgmv_reference(*paged_args))
        )

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_pool_rows_wider_than_in_and_out(self, dtype):
        """Rows of the pools wider than x and y, NaN past them (the KV cache's pages seen
        as rank rows): the output of the exact pools, bit for bit."""
        args, _, slots = _paged_case(10, kernel_cases.MIXED_RANKS, 16, 16, "uniform", dtype)
        kernel_cases.check_wider_pool_rows(
            mbgmv, mbgmv_reference, args, slots, interpret=self.INTERPRET
        )


class TestMbgmvInterpret(TestMbgmv):
    INTERPRET = True


class TestLowering:
    """The compiled kernel lowers for CUDA through Triton at Llama-2-7B shapes (on CPU)."""

    @pytest.mark.parametrize(
        "fan_in, fan_out, row_width",
        # row_width: the pools' rows, where wider (the KV cache's pages seen as rows)
        [(4096, 4096, 0), (4096, 11008, 0), (11008, 4096, 0), (11008, 4096, 16384)],
    )
    def test_llama2_7b_lowers_to_triton(self, fan_in, fan_out, row_width):
        rows, slots, rank_dim, layers, dtype = 32, 16, 64, 32, jnp.bfloat16
        pool = slots * rank_dim
        shapes = [
            ((rows, fan_out), dtype),  # y
            ((rows, fan_in), dtype),  # x
            ((layers, pool, max(fan_in, row_width)), dtype),  # a_pool
            ((layers, pool, max(fan_out, row_width)), dtype),  # b_pool
            ((rows,), jnp.int32),  # idx
            ((slots, rank_dim), jnp.int32),  # pages
            ((slots,), jnp.int32),  # ranks
            ((), jnp.int32),  # layer
        ]
        assert kernel_cases.triton_calls(mbgmv, shapes) == 2  # shrink and expand


def _valid_args():
    return _paged_case(9, kernel_cases.MIXED_RANKS, 16, 7, "uniform", "float32")[0]


def _with(position, change):
    return kernel_cases.with_changed(_valid_args(), position, change)


BAD_ARGS = {
    **kernel_cases.POOL_KERNEL_ERRORS,
    "idx length differs from rows": ("idx", 4, lambda i: i[:-1]),
    "idx dtype float32": ("idx", 4, lambda i: i.astype(jnp.float32)),
    "pages rank dim 12": ("pages", 5, lambda p: p[:, :12]),
    "pages dtype int16": ("pages", 5, lambda p: p.astype(jnp.int16)),
    "ranks length differs from slots": ("ranks", 6, lambda r: r[:-1]),
    "ranks dtype uint32": ("ranks", 6, lambda r: r.astype(jnp.uint32)),
}


@pytest.mark.parametrize("function", ["kernel", "reference"])
@pytest.mark.parametrize("case", BAD_ARGS)
def test_argument_errors_name_the_argument(case, function):
    name, position, change = BAD_ARGS[case]
    call = {"kernel": lambda *a: mbgmv(*a, interpret=True), "reference": mbgmv_reference}
    with pytest.raises(common.KernelArgumentError, match=rf"\b{name}\b"):
        call[function](*_with(position, change))
