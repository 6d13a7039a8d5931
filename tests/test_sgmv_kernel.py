"""SGMV: the reference on hand-computed cases and against the naive loop, then the kernel
against the reference over the adapter-mix sweep and hand-made segmentations, its GPU
lowering, and argument errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.sgmv import check_sgmv_args, sgmv, sgmv_reference, sgmv_shrink
from tests import kernel_cases
from tests.tolerances import assert_close

NAN = np.nan
FAN_IN, FAN_OUT, LAYERS = 64, 48, 2
# The sweep pads its segments to this many (empty ones at the end), so that every batch
# size compiles the kernel once per dtype: sorted rows of 8 slots make at most 9 runs.
SWEEP_SEGMENTS = 12


def _tiny_f32():
    """Two slots in a 4-page pool (layer 0 all NaN, layer 1 used), five rows, three segments.

    Segment 0, rows 0-1, slot 0 (rank 2, pages 3, 0):
      row 0, x = [1, 1]: v = [x . a3, x . a0] = [3, 3]
        y += 3 * b3 + 3 * b0 = [3, 3] + [3, 0]: [10, 20] -> [16, 23]
      row 1, x = [1, 0]: v = [3, 1];  y += 3 * [1, 1] + 1 * [1, 0] = [4, 3]: [1, 1] -> [5, 4]
    Segment 1, row 2, slot -1: [50, 60] stays.
    Segment 2, row 3, slot 1 (rank 1, pages 1, 2): page 2 is past the rank (NaN, ignored)
      x = [2, 1]: v = [x . a1] = [2*0 + 1*1] = [1];  y += 1 * b1 = [0, 2]: [30, 40] -> [30, 42]
    Row 4 is past seg_start[3] = 4: [7, 8] stays.
    """
    a_pool = np.full((2, 4, 2), NAN, np.float32)
    b_pool = np.full((2, 4, 2), NAN, np.float32)
    a_pool[1, [0, 1, 3]] = [[1, 2], [0, 1], [3, 0]]
    b_pool[1, [0, 1, 3]] = [[1, 0], [0, 2], [1, 1]]
    args = (
        jnp.array([[10, 20], [1, 1], [50, 60], [30, 40], [7, 8]], jnp.float32),  # y
        jnp.array([[1, 1], [1, 0], [5, 5], [2, 1], [1, 1]], jnp.float32),  # x
        jnp.asarray(a_pool),
        jnp.asarray(b_pool),
        jnp.array([0, -1, 1], jnp.int32),  # seg_slot
        jnp.array([0, 2, 3, 4], jnp.int32),  # seg_start
        jnp.array([[3, 0], [1, 2]], jnp.int32),  # pages
        jnp.array([2, 1], jnp.int32),  # ranks
        1,  # layer
    )
    return args, np.array([[16, 23], [5, 4], [50, 60], [30, 42], [7, 8]], np.float32)


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
        jnp.array([0], jnp.int32),  # seg_slot
        jnp.array([0, 1], jnp.int32),  # seg_start
        jnp.array([[0]], jnp.int32),  # pages
        jnp.array([1], jnp.int32),  # ranks
        0,  # layer
    )
    return args, np.array([[2]], np.float32)


TINY = {"f32": _tiny_f32, "bf16": _tiny_bf16}

# Hand-made segmentation of 40 rows (three tiles of 16 after padding): rows 0-2 before the
# first segment, [3, 10) slot 2, an empty segment of slot 5, [10, 17) without adapter,
# [17, 20) slot 2 again, [20, 26) and [26, 33) both slot 0 (across a tile boundary), rows
# 33-39 past the last segment.
HAND_ROWS = 40
HAND_SEGMENTS = ([2, 5, -1, 2, 0, 0], [3, 10, 10, 17, 20, 26, 33])


def _slots_by_row(seg_slot, seg_start, rows):
    """i32[rows]: each row's slot under a segmentation, -1 for rows in no segment."""
    slots = np.full(rows, -1, np.int32)
    for slot, start, end in zip(seg_slot, seg_start[:-1], seg_start[1:], strict=True):
        slots[start:end] = slot
    return slots


def _padded(seg_slot, seg_start, num_segments, num_slots):
    """The same segmentation with empty segments appended (of real slots and of -1)."""
    extra = num_segments - len(seg_slot)
    filler = np.where(np.arange(extra) % 2 == 0, np.arange(extra) % num_slots, -1)
    seg_slot = np.concatenate([seg_slot, filler]).astype(np.int32)
    return seg_slot, np.concatenate([seg_start, np.full(extra, seg_start[-1])]).astype(np.int32)


def _case(seed, ranks, rank_dim, batch, popularity, dtype, fan_in=FAN_IN, fan_out=FAN_OUT):
    """(sgmv args, adapters, row slots) for a mix of adapters laid out by kernel_cases.paged.

    `popularity` names a kernel_cases mix, whose rows are sorted by slot into segments
    (padded to SWEEP_SEGMENTS), or is a hand-made segmentation (seg_slot, seg_start)."""
    rng = np.random.default_rng(seed)
    adapters = kernel_cases.make_adapters(rng, ranks, fan_in, fan_out, LAYERS)
    a_pool, b_pool, pages, slot_ranks = kernel_cases.paged(adapters, rank_dim, rng, dtype)
    if isinstance(popularity, str):
        slots = np.sort(kernel_cases.row_slots(popularity, batch, len(ranks), rng))
        segments = _padded(*kernel_cases.segments_of(slots), SWEEP_SEGMENTS, len(ranks))
    else:
        segments, slots = popularity, _slots_by_row(*popularity, batch)
    y, x = kernel_cases.activations(rng, batch, fan_in, fan_out, dtype)
    segments = tuple(jnp.asarray(s, jnp.int32) for s in segments)
    return (y, x, a_pool, b_pool, *segments, pages, slot_ranks, LAYERS - 1), adapters, slots


@pytest.mark.parametrize("name", TINY)
def test_reference_tiny(name):
    args, expected = TINY[name]()
    out = sgmv_reference(*args)
    assert out.dtype == args[0].dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)


@pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
@pytest.mark.parametrize(
    "popularity, batch",
    [("uniform", 7), ("zipf", 16), (HAND_SEGMENTS, HAND_ROWS)],
    ids=["uniform", "zipf", "hand-made"],
)
def test_reference_matches_naive(popularity, batch, dtype):
    args, adapters, slots = _case(1, kernel_cases.MIXED_RANKS, 16, batch, popularity, dtype)
    expected = kernel_cases.naive(args[0], args[1], adapters, slots, LAYERS - 1, dtype)
    assert_close(sgmv_reference(*args), expected, dtype, dtype, scope="op")
    kernel_cases.assert_untouched(args[0], sgmv_reference(*args), slots)


class TestSgmv:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _device(self):
        kernel_cases.gpu_or_skip(self.INTERPRET)

    def _check(self, args, slots):
        return kernel_cases.check_kernel(
            sgmv, sgmv_reference, args, slots, interpret=self.INTERPRET
        )

    @pytest.mark.parametrize("name", TINY)
    def test_tiny(self, name):
        if not self.INTERPRET:
            pytest.skip("compiled Triton dots need dimensions >= 16 (see test_compiled_sizes)")
        args, expected = TINY[name]()
        slots = _slots_by_row(np.asarray(args[4]), np.asarray(args[5]), args[0].shape[0])
        out = self._check(args, slots)
        np.testing.assert_array_equal(np.asarray(out, np.float32), expected)

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    @pytest.mark.parametrize("batch", kernel_cases.BATCHES)
    @pytest.mark.parametrize("popularity", kernel_cases.POPULARITY)
    def test_mixed_ranks(self, popularity, batch, dtype):
        args, _, slots = _case(2, kernel_cases.MIXED_RANKS, 16, batch, popularity, dtype)
        self._check(args, slots)

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    @pytest.mark.parametrize("popularity", ["uniform", "skewed"])
    def test_wide_ranks(self, popularity, dtype):
        args, _, slots = _case(3, kernel_cases.WIDE_RANKS, 64, 40, popularity, dtype)
        self._check(args, slots)

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_shrink_alone(self, dtype):
        args, adapters, slots = _case(5, kernel_cases.WIDE_RANKS, 64, 21, "uniform", dtype)
        _, x, a_pool, _, seg_slot, seg_start, pages, ranks, layer = args
        v = sgmv_shrink(
            x, a_pool, seg_slot, seg_start, pages, ranks, layer, interpret=self.INTERPRET
        )
        expected = kernel_cases.naive_shrink(x, adapters, slots, layer, dtype, 64)
        assert_close(v, expected, dtype, "float32", scope="op")

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_hand_made_segments(self, dtype):
        """Empty and -1 segments, a repeated slot, rows before and past the segments."""
        args, adapters, slots = _case(
            1, kernel_cases.MIXED_RANKS, 16, HAND_ROWS, HAND_SEGMENTS, dtype
        )
        out = self._check(args, slots)
        expected = kernel_cases.naive(args[0], args[1], adapters, slots, LAYERS - 1, dtype)
        assert_close(out, expected, dtype, dtype, scope="op")

    def test_rank_zero_slots_add_nothing(self):
        args, _, slots = _case(4, (0, 5, 16, 0), 16, 16, "distinct", "float32")
        out = self._check(args, slots)
        rank_zero_rows = np.isin(slots, [0, 3])
        assert rank_zero_rows.any()
        np.testing.assert_array_equal(
            np.asarray(out)[rank_zero_rows], np.asarray(args[0])[rank_zero_rows]
        )

    @pytest.mark.parametrize(
        "seg_slot, seg_start",
        [([-1], [0, 7]), ([-1, 3, -1], [0, 4, 4, 7]), ([2, 5], [0, 0, 0])],
        ids=["one -1 segment", "-1 around an empty segment", "empty segments only"],
    )
    def test_all_rows_without_adapter(self, seg_slot, seg_start):
        segments = (seg_slot, seg_start)
        args, _, slots = _case(5, kernel_cases.MIXED_RANKS, 16, 7, segments, "bfloat16")
        assert (slots == -1).all()
        self._check(args, slots)

    @pytest.mark.parametrize("layer", [0, 1])
    def test_each_layer(self, layer):
        args, adapters, slots = _case(6, kernel_cases.MIXED_RANKS, 16, 7, "zipf", "float32")
        args = (*args[:8], layer)
        out = self._check(args, slots)
        expected = kernel_cases.naive(args[0], args[1], adapters, slots, layer, "float32")
        assert_close(out, expected, "float32", "float32", scope="op")

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_smollm2_shape(self, dtype):
        """SmolLM2-135M's k/v projection, 576 -> 192: several `in` blocks and `out` tiles."""
        args, _, slots = _case(7, kernel_cases.MIXED_RANKS, 16, 40, "uniform", dtype, 576, 192)
        self._check(args, slots)

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_stacked_and_paged_layouts_agree(self, dtype):
        """The same adapters, stacked ([L, N, R, in] as a pool) or scattered through a pool."""
        paged_args, adapters, slots = _case(8, kernel_cases.MIXED_RANKS, 16, 16, "uniform", dtype)
        a, b, ranks = kernel_cases.stacked(adapters, 16, dtype)
        stacked_pool = (a.reshape(LAYERS, -1, FAN_IN), b.reshape(LAYERS, -1, FAN_OUT))
        stacked_pages = common.stacked_pages(len(adapters), 16)
        stacked_args = (
            *paged_args[:2],
            *stacked_pool,
            *paged_args[4:6],
            stacked_pages,
            ranks,
            LAYERS - 1,
        )
        from_stacked = self._check(stacked_args, slots)
        from_paged = self._check(paged_args, slots)
        np.testing.assert_array_equal(np.asarray(from_stacked), np.asarray(from_paged))
        np.testing.assert_array_equal(
            np.asarray(sgmv_reference(*stacked_args)), np.asarray(sgmv_reference(*paged_args))
        )

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_pool_rows_wider_than_in_and_out(self, dtype):
        """Rows of the pools wider than x and y, NaN past them (the KV cache's pages seen
        as rank rows): the output of the exact pools, bit for bit."""
        args, _, slots = _case(10, kernel_cases.MIXED_RANKS, 16, 16, "uniform", dtype)
        kernel_cases.check_wider_pool_rows(
            sgmv, sgmv_reference, args, slots, interpret=self.INTERPRET
        )


class TestSgmvInterpret(TestSgmv):
    INTERPRET = True


class TestLowering:
    """The compiled kernel lowers for CUDA through Triton at Llama-2-7B shapes (on CPU)."""

    @pytest.mark.parametrize(
        "fan_in, fan_out, row_width",
        # row_width: the pools' rows, where wider (the KV cache's pages seen as rows)
        [(4096, 4096, 0), (4096, 11008, 0), (11008, 4096, 0), (11008, 4096, 16384)],
    )
    def test_llama2_7b_lowers_to_triton(self, fan_in, fan_out, row_width):
        rows, segments, slots, rank_dim, layers, dtype = 32, 5, 16, 64, 32, jnp.bfloat16
        pool = slots * rank_dim
        shapes = [
            ((rows, fan_out), dtype),  # y
            ((rows, fan_in), dtype),  # x
            ((layers, pool, max(fan_in, row_width)), dtype),  # a_pool
            ((layers, pool, max(fan_out, row_width)), dtype),  # b_pool
            ((segments,), jnp.int32),  # seg_slot
            ((segments + 1,), jnp.int32),  # seg_start
            ((slots, rank_dim), jnp.int32),  # pages
            ((slots,), jnp.int32),  # ranks
            ((), jnp.int32),  # layer
        ]
        assert kernel_cases.triton_calls(sgmv, shapes) == 2  # shrink and expand


def _valid_args():
    return _case(9, kernel_cases.MIXED_RANKS, 16, 7, "uniform", "float32")[0]


def _with(position, change):
    return kernel_cases.with_changed(_valid_args(), position, change)


BAD_ARGS = {
    **kernel_cases.POOL_KERNEL_ERRORS,
    "seg_slot not a vector": ("seg_slot", 4, lambda s: s[:, None]),
    "seg_slot dtype float32": ("seg_slot", 4, lambda s: s.astype(jnp.float32)),
    "seg_start not G + 1 long": ("seg_start", 5, lambda s: s[:-1]),
    "seg_start dtype uint32": ("seg_start", 5, lambda s: s.astype(jnp.uint32)),
    "pages rank dim 12": ("pages", 6, lambda p: p[:, :12]),
    "pages dtype int16": ("pages", 6, lambda p: p.astype(jnp.int16)),
    "ranks length differs from slots": ("ranks", 7, lambda r: r[:-1]),
    "ranks dtype uint32": ("ranks", 7, lambda r: r.astype(jnp.uint32)),
}


@pytest.mark.parametrize("function", ["kernel", "reference"])
@pytest.mark.parametrize("case", BAD_ARGS)
def test_argument_errors_name_the_argument(case, function):
    name, position, change = BAD_ARGS[case]
    call = {"kernel": lambda *a: sgmv(*a, interpret=True), "reference": sgmv_reference}
    with pytest.raises(common.KernelArgumentError, match=rf"\b{name}\b"):
        call[function](*_with(position, change))


@pytest.mark.parametrize(
    "name, fan_in, fan_out, ranks, rank_dim",
    [("x", 24, 48, (3, 5), 16), ("y", 64, 40, (3, 5), 16), ("pages", 64, 48, (3, 5), 8)],
)
def test_compiled_sizes(name, fan_in, fan_out, ranks, rank_dim):
    """Compiled Triton dots need `in`, `out` multiples of 16 and R >= 16; the interpreter
    takes any size (and so does the reference)."""
    args, _, _ = _case(10, ranks, rank_dim, 7, "uniform", "float32", fan_in, fan_out)
    with pytest.raises(common.KernelArgumentError, match=rf"\b{name}\b"):
        sgmv(*args, interpret=False)
    with pytest.raises(common.KernelArgumentError, match=rf"\b{name}\b"):
        check_sgmv_args(*args[:8], compiled=True)
    assert check_sgmv_args(*args[:8]) == (7, fan_in, fan_out, rank_dim)
    assert_close(
        sgmv(*args, interpret=True), sgmv_reference(*args), "float32", "float32", scope="op"
    )
