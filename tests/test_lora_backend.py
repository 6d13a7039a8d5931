"""Every LoRA backend against a naive loop, through its own device layout.

The loop is the semantics written out (jlora/model/lora/base.py): for each row, if its slot
is not -1, y += x @ A[layer, slot] @ B[layer, slot], in fp32 and one row at a time.
Each backend packs and installs the same adapters into its layout (stacked, padded
slots or a page pool), so these tests cover pack, install and both kernel forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import ConfigError
from configs.engine import LORA_BACKENDS
from cpu_offload.kernels.blas import block_rows
from jlora.model.host import sgmv as host_sgmv
from jlora.model.host.backend import HostPooledBackend
from jlora.model.kv_cache import KVCache
from jlora.model.lora.backends import BACKENDS, make_backend
from jlora.model.lora.base import Segments, layer_group
from jlora.model.lora.pallas import PagePool, kernel_rank_dim
from tests.kernel_cases import assert_untouched
from tests.tolerances import assert_close

SHAPES = {"q_proj": (24, 40), "down_proj": (56, 24)}
LAYERS, SLOTS, MAX_RANK = 3, 4, 16
RANKS = (16, 1, 5, 8)  # slot i holds an adapter of rank RANKS[i]; 5 is not a power of two


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


# The pooled backends' KV cache: 200 pages of 2 × 4 tokens × 2 heads × 16 dims (256 values
# a layer, 128 in each half); slot s's adapters get pages POOL_PAGES[s], scattered over
# the pool between pages that KV keeps (which installs must leave alone).
POOL_SHAPE = (LAYERS, 200, 4, 2, 16)
# "reference-host": the pooled reference served by the host kernels (jlora.model.host).
POOLED = ("reference-pooled", "mbgmv-pooled", "reference-host")
POOL_PAGES = np.random.default_rng(1).permutation(200)[: SLOTS * 48].reshape(SLOTS, 48)


def _pool(dtype):
    """A KV cache full of values (KV that sits in the pages adapters do not take)."""
    rng = np.random.default_rng(2)
    return KVCache(
        k=jnp.asarray(rng.standard_normal(POOL_SHAPE), dtype),
        v=jnp.asarray(rng.standard_normal(POOL_SHAPE), dtype),
    )


def _backend(name):
    if name in POOLED:
        base, where = name.split("-")
        return make_backend(base, 2 * int(np.prod(POOL_SHAPE[2:])), host=where == "host")
    return make_backend(name)


def _install(backend, weights, slot, tensors, dtype, groups=((0, LAYERS),)):
    """Pack an adapter and install it layer group by layer group (pipelined loading)."""
    pages = list(POOL_PAGES[slot]) if backend.pooled else None
    payload = backend.pack(
        tensors, slot=slot, shapes=SHAPES, max_rank=MAX_RANK, dtype=dtype, pages=pages
    )
    for start, stop in groups:
        group = layer_group(payload, start, stop)
        weights = backend.install(weights, jnp.int32(slot), jnp.int32(start), group)
    return weights


@pytest.fixture(scope="module", params=(*LORA_BACKENDS, *POOLED))
def slots(request):
    """Per dtype, a backend and its device slots holding four adapters (slot 2 adapts
    only q_proj); and the adapters' tensors."""
    rng = np.random.default_rng(0)
    adapters = [
        _adapter(rng, rank, targets=("q_proj",) if i == 2 else SHAPES)
        for i, rank in enumerate(RANKS)
    ]
    by_dtype = {}
    for dtype in ("float32", "bfloat16"):
        backend = _backend(request.param)
        w = backend.allocate(
            num_layers=LAYERS, num_slots=SLOTS, max_rank=MAX_RANK, shapes=SHAPES, dtype=dtype
        )
        w = backend.with_pool(w, _pool(dtype))
        for slot, tensors in enumerate(adapters):
            # Slot 1 lands in two layer groups, slot 3 in three, the others whole.
            groups = {1: ((0, 1), (1, LAYERS)), 3: ((2, 3), (0, 1), (1, 2))}
            w = _install(backend, w, slot, tensors, dtype, groups.get(slot, ((0, LAYERS),)))
        by_dtype[dtype] = backend, w
    return by_dtype, adapters


def _naive(adapters, target, layer, y, x, row_slots, dtype="float32"):
    """fp32, one row at a time, on the weights and activations as stored in `dtype`."""
    out = _stored(y, dtype).copy()
    for row, slot in enumerate(row_slots):
        if slot >= 0 and target in adapters[slot]:
            a, b = (_stored(w[layer], dtype) for w in adapters[slot][target])
            out[row] += _stored(_stored(x[row], dtype) @ a, dtype) @ b
    return out


def _stored(array, dtype):
    return np.asarray(jnp.asarray(array, dtype), np.float32)


def _activations(rows, target, seed, dtype):
    rng = np.random.default_rng(seed)
    fan_in, fan_out = SHAPES[target]
    y, x = rng.standard_normal((rows, fan_out)), rng.standard_normal((rows, fan_in))
    return jnp.asarray(y, dtype), jnp.asarray(x, dtype)


def test_naive_loop_by_hand():
    # One row, rank 1: x = [1, 2], A = [[3], [4]] -> x @ A = 11; B = [[5, 6]] -> [55, 66],
    # added to y = [1, 1]. The second row has no adapter: its y stays [2, 2].
    adapters = [{"t": (np.array([[[3.0], [4.0]]]), np.array([[[5.0, 6.0]]]))}]
    x = np.array([[1.0, 2.0], [7.0, 7.0]], np.float32)
    y = np.array([[1.0, 1.0], [2.0, 2.0]], np.float32)
    out = _naive(adapters, "t", 0, y, x, [0, -1])
    np.testing.assert_array_equal(out, [[56.0, 67.0], [2.0, 2.0]])


def test_the_registry_serves_every_configured_backend():
    assert set(BACKENDS) == set(LORA_BACKENDS)
    with pytest.raises(ValueError, match="lora_backend='punica'"):
        make_backend("punica")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("target", sorted(SHAPES))
@pytest.mark.parametrize(
    "row_slots",
    [[0], [-1], [3, 3, 3], [0, 1, 2, 3], [2, -1, 0, -1, 1, 1, 3], [-1, -1, -1]],
    ids=["one", "none", "identical", "distinct", "mixed", "all-base"],
)
def test_bgmv_matches_the_loop(slots, dtype, target, row_slots):
    """Every decode form of the backend (the reference's gather and product over slots)."""
    (backend, weights), adapters = slots[0][dtype], slots[1]
    y, x = _activations(len(row_slots), target, len(row_slots), dtype)
    for _form in _decode_forms(backend):
        bgmv = jax.jit(backend.bgmv, static_argnums=1)  # traced with the form set
        for layer in range(LAYERS):
            out = bgmv(weights, target, jnp.int32(layer), x, y, jnp.array(row_slots))
            expected = _naive(adapters, target, layer, y, x, row_slots, dtype)
            assert_close(out, expected, dtype, dtype, scope="op")
            assert_untouched(y, out, row_slots)


def _decode_forms(backend):
    """Yields each decode form the backend has, set on it while the caller runs it: the
    reference's gather, its product over every slot, and its product over the batch's
    own slots where they are at most batch_slots = 2 (else the gather, at run time: both
    happen among the row mixes above). The host backend has one form: its kernel in fp32
    (jlora/model/host/bgmv.py), the reference's in bfloat16."""
    if not hasattr(backend, "decode_form") or isinstance(backend, HostPooledBackend):
        yield "the backend's"
        return
    try:
        for form in ("gather", "over-slots"):
            backend.decode_form = form
            yield form
        del backend.decode_form
        backend.batch_slots = 2
        backend.over_slots = lambda rows, slots: slots == backend.batch_slots
        yield "over the batch's slots"
    finally:
        for attribute in ("decode_form", "batch_slots", "over_slots"):
            backend.__dict__.pop(attribute, None)  # the class's again


def test_the_reference_decode_form_follows_rows_and_slots():
    backend = make_backend("reference")
    assert backend.over_slots(rows=32, slots=8) and backend.over_slots(rows=16, slots=4)
    assert not backend.over_slots(rows=16, slots=16) and not backend.over_slots(8, 8)
    backend.decode_form = "gather"
    assert not backend.over_slots(rows=32, slots=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "segment_slots, starts, window",
    [
        ([1], [0, 9], None),
        ([-1], [0, 9], None),
        ([2, -1, 0], [0, 3, 4, 7], None),
        ([3, 1], [0, 0, 5], None),
        ([2, 2, -1, 0, 3, -1], [0, 3, 5, 6, 8, 9, 9], 3),
    ],
    ids=["one", "none", "mixed-with-padding", "empty-segment", "packed"],
)
@pytest.mark.parametrize("target", ["q_proj", "down_proj"])
def test_sgmv_matches_the_loop(slots, dtype, segment_slots, starts, window, target):
    """Each prefill form: the reference's loop over segments (each over every row, or a
    packed call's over a window of rows), and the host backend's kernel
    (jlora/model/host/sgmv.py; fp32, in bfloat16 the loop again)."""
    (backend, weights), adapters = slots[0][dtype], slots[1]
    rows = 9
    row_slots = [-1] * rows
    for slot, begin, end in zip(segment_slots, starts, starts[1:], strict=False):
        row_slots[begin:end] = [slot] * (end - begin)
    segments = Segments(slot=jnp.array(segment_slots), start=jnp.array(starts), window=window)
    y, x = _activations(rows, target, 1, dtype)
    expected = _naive(adapters, target, 1, y, x, row_slots, dtype)
    out = jax.jit(backend.sgmv, static_argnums=1)(weights, target, jnp.int32(1), x, y, segments)
    assert_close(out, expected, dtype, dtype, scope="op")
    assert_untouched(y, out, row_slots)


@pytest.mark.parametrize("blocks", [False, True], ids=["one-call", "blocks"])
def test_the_host_sgmv_kernel_makes_long_segments_right_in_blocks_or_in_one_call(blocks):
    """host_sgmv's kernel on segments long enough for several sgemm calls where it makes
    its products in blocks (rank 16 from 576 inputs: 104 rows a call; into 1536 outputs:
    40), against numpy: each adapted segment's rows get y + x @ A @ B, the others keep y,
    whether or not this machine's OpenBLAS has the small-product path the blocks are for."""
    rng = np.random.default_rng(7)
    fan_in, fan_out, layer = 576, 1536, 1
    k, v = (rng.standard_normal((2, 100, 4, 4, 64), np.float32) for _ in range(2))  # 1024 a page
    starts = np.array([0, 250, 260, 400, 403], np.int32)
    rank = np.array([16, 0, 3, 16], np.int32)
    table = rng.permutation(100)[: 4 * 24].reshape(4, 24).astype(np.int32)
    x = rng.standard_normal((420, fan_in), np.float32)  # rows from 403 on are padding
    y = rng.standard_normal((420, fan_out), np.float32)
    expected = y.copy()
    for g, r in enumerate(rank):
        a = rng.standard_normal((fan_in, r), np.float32) / np.float32(np.sqrt(fan_in))
        b = rng.standard_normal((r, fan_out), np.float32) / np.float32(max(r, 1))
        for half, flat in ((k, a.T.ravel()), (v, b.ravel())):  # as the pooled backend lays them
            pages = half[layer].reshape(100, -1)
            for p in range(-(-flat.size // 1024)):
                chunk = flat[p * 1024 : (p + 1) * 1024]
                pages[table[g, p], : chunk.size] = chunk
        rows = slice(starts[g], starts[g + 1])
        expected[rows] += (x[rows].astype(np.float64) @ a @ b).astype(np.float32)
    out = np.empty_like(y)
    host_sgmv.sgmv_pages(x, y, k, v, table, rank, starts, np.int32(layer), out, blocks)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert (out[403:] == y[403:]).all() and (out[250:260] == y[250:260]).all()
    assert block_rows(16, fan_in) == 104 and block_rows(fan_out, 16) == 40


def _rows(form: str):
    """(the backend's rows argument, each row's slot): a mixed batch, both forms."""
    if form == "decode":
        row_slots = [2, -1, 0, -1, 1, 1, 3]
        return jnp.array(row_slots), row_slots
    segment_slots, starts = [2, -1, 0, 3], [0, 3, 4, 7, 9]
    row_slots = [
        slot
        for slot, a, b in zip(segment_slots, starts[:-1], starts[1:], strict=True)
        for _ in range(b - a)
    ]
    return Segments(slot=jnp.array(segment_slots), start=jnp.array(starts)), row_slots


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_the_two_halves_match_the_loop(slots, dtype, form):
    """shrink, then expand (the form a LoRA split across devices takes) give the loop's
    answer; in a Pallas backend, bit for bit the fused kernels'."""
    (backend, weights), adapters = slots[0][dtype], slots[1]
    rows, row_slots = _rows(form)
    y, x = _activations(len(row_slots), "q_proj", 5, dtype)
    layer = jnp.int32(1)
    xa = backend.shrink(weights, "q_proj", layer, x, rows)
    assert xa.dtype == jnp.float32
    out = backend.expand(weights, "q_proj", layer, xa.astype(dtype), y, rows)
    assert_close(
        out, _naive(adapters, "q_proj", 1, y, x, row_slots, dtype), dtype, dtype, scope="op"
    )
    assert_untouched(y, out, row_slots)
    if backend.name != "reference":
        fused = (backend.bgmv if form == "decode" else backend.sgmv)(
            weights, "q_proj", layer, x, y, rows
        )
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(fused, np.float32))


@pytest.mark.parametrize("name", [n for n in LORA_BACKENDS if "rank" in BACKENDS[n].layout["a"]])
@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_a_rank_split_over_two_devices_matches_the_loop(name, form):
    """Fully-sharded stacked slots: two devices each hold half of every slot's rank rows
    of A (ranks above, across and below the halves' boundary); each shrinks with its
    part's index, the halves joined (the all-gather) and expanded give the loop's answer."""
    backend, rng = make_backend(name), np.random.default_rng(9)
    ranks = (40, 17, 5, 33)
    adapters = [_adapter(rng, rank) for rank in ranks]
    weights = backend.allocate(
        num_layers=LAYERS, num_slots=SLOTS, max_rank=48, shapes=SHAPES, dtype="float32",
        rank_shards=2,
    )  # fmt: skip
    for slot, tensors in enumerate(adapters):
        payload = backend.pack(
            tensors, slot=slot, shapes=SHAPES, max_rank=48, dtype="float32", rank_shards=2
        )
        weights = backend.install(weights, jnp.int32(slot), jnp.int32(0), payload)
    axis = backend.layout["a"].index("rank")
    half = weights["q_proj"]["a"].shape[axis] // 2
    assert half >= 24  # the rank dim holds max_rank 48 in two equal parts
    rows, row_slots = _rows(form)
    y, x = _activations(len(row_slots), "q_proj", 6, "float32")
    parts = []
    for k in range(2):
        a_part = jnp.take(weights["q_proj"]["a"], jnp.arange(k * half, (k + 1) * half), axis)
        part = {"q_proj": {**weights["q_proj"], "a": a_part}}
        parts.append(backend.shrink(part, "q_proj", jnp.int32(2), x, rows, jnp.int32(k)))
    xa = jnp.concatenate(parts, axis=1)
    out = backend.expand(weights, "q_proj", jnp.int32(2), xa, y, rows)
    expected = _naive(adapters, "q_proj", 2, y, x, row_slots)
    assert_close(out, expected, "float32", "float32", scope="op")


def test_replacing_a_slot_changes_only_its_rows(slots):
    """Install a rank-3 adapter over slot 1: slot 1's rows follow it, other rows don't
    move (in the page pool, the new adapter's pages must not clobber other slots')."""
    (backend, weights), adapters = slots[0]["float32"], slots[1]
    replacement = _adapter(np.random.default_rng(7), 3)
    updated = _install(backend, weights, 1, replacement, "float32")
    now = adapters[:1] + [replacement] + adapters[2:]
    row_slots = [0, 1, 2, 3, -1, 1]
    y, x = _activations(len(row_slots), "down_proj", 3, "float32")
    out = backend.bgmv(updated, "down_proj", jnp.int32(2), x, y, jnp.array(row_slots))
    expected = _naive(now, "down_proj", 2, y, x, row_slots)
    assert_close(out, expected, "float32", "float32", scope="op")


def test_a_target_the_rows_adapters_leave_alone_reads_none_of_its_slots(slots):
    """Slot 2's adapter adapts q_proj only: rows on it (and base rows) keep y's bits in
    down_proj whatever that slot's down_proj factors hold (NaN here), in both forms."""
    (backend, weights), _ = slots[0]["float32"], slots[1]
    if "slot" not in backend.layout.get("a", ()):
        pytest.skip("stacked layouts only: a paged slot owns no down_proj pages to poison")
    poisoned = {**weights, "down_proj": dict(weights["down_proj"])}
    for part in ("a", "b"):
        poisoned["down_proj"][part] = weights["down_proj"][part].at[:, 2].set(jnp.nan)
    y, x = _activations(3, "down_proj", 5, "float32")
    out = backend.bgmv(poisoned, "down_proj", jnp.int32(1), x, y, jnp.array([2, -1, 2]))
    np.testing.assert_array_equal(out, y)
    segments = Segments(slot=jnp.array([2, -1]), start=jnp.array([0, 2, 3]))
    out = backend.sgmv(poisoned, "down_proj", jnp.int32(1), x, y, segments)
    np.testing.assert_array_equal(out, y)


@pytest.mark.parametrize(
    "name, rows_per_page, pages",
    [
        # A^T's rows fill the pages' key halves (128 values a layer) in order, B's their
        # value halves: rank 16 takes max(16 × 24, 16 × 40) / 128 = 5 pages for q_proj
        # and 16 × 56 / 128 = 7 for down_proj; rank 1 (a bucket of 1 row) one of each;
        # rank 5 (a bucket of 8 rows) 8 × 40 / 128 = 3 for q_proj.
        ("reference-pooled", 1, (12, 2, 3)),
        # Each rank row whole, 64 values apart (the smallest divisor of 128 at least
        # max(24, 40) and max(56, 24)): two a page, so rank 16 takes 8 pages of each
        # target, rank 1 one of each, rank 5 three for q_proj.
        ("mbgmv-pooled", 2, (16, 2, 3)),
    ],
)
def test_a_pooled_install_writes_its_own_pages_alone(name, rows_per_page, pages):
    """A pooled backend's adapters sit in the KV cache: installing them leaves every
    other page's keys and values as they were, a slot's table lists its pages (MBGMV's:
    rows of them), and an adapter takes the pages its rank rows fill."""
    backend, rng = _backend(name), np.random.default_rng(4)
    weights = backend.allocate(
        num_layers=LAYERS, num_slots=SLOTS, max_rank=MAX_RANK, shapes=SHAPES, dtype="float32"
    )
    before = _pool("float32")
    weights = backend.with_pool(weights, before)
    for slot, rank in enumerate(RANKS):
        weights = _install(backend, weights, slot, _adapter(rng, rank), "float32")
    tables = [np.asarray(weights[target]["pages"]) // rows_per_page for target in SHAPES]
    taken = {int(page) for table in tables for page in table.flat}
    assert taken <= set(POOL_PAGES.flat)
    kept = np.setdiff1d(np.arange(POOL_SHAPE[1]), sorted(taken))
    assert len(kept) >= 200 - 4 * 48
    for part in ("k", "v"):
        np.testing.assert_array_equal(
            np.asarray(weights["pool"][part])[:, kept], np.asarray(getattr(before, part))[:, kept]
        )
    got = (
        backend.pool_pages(16, list(SHAPES)),
        backend.pool_pages(1, list(SHAPES)),
        backend.pool_pages(5, ["q_proj"]),
    )
    assert got == pages


def test_pooled_mbgmv_refuses_rows_wider_than_a_pages_half():
    """A rank row lies whole in a page's half: q_proj's 40 values do not fit in 32."""
    backend = make_backend("mbgmv", page_width=2 * 4 * 2 * 4)
    with pytest.raises(ConfigError, match=r"q_proj's rows are 40 wide: raise block_size 2-fold"):
        backend.allocate(
            num_layers=LAYERS, num_slots=SLOTS, max_rank=MAX_RANK, shapes=SHAPES, dtype="float32"
        )


def test_the_page_pool_never_runs_out_and_never_shares_a_page():
    pool, rng = PagePool(num_slots=3, max_rank=8), np.random.default_rng(0)
    for _ in range(200):
        pool.assign(int(rng.integers(3)), int(rng.integers(0, 9)))
        owned = [pool.owned(slot) for slot in range(3)]
        flat = [page for pages in owned for page in pages]
        assert len(flat) == len(set(flat)), "two slots share a page"
        assert all(0 <= page < pool.num_pages for page in flat)


def test_rank_dim_is_a_power_of_two_of_at_least_16():
    assert [kernel_rank_dim(r) for r in (1, 5, 16, 17, 64, 65)] == [16, 16, 16, 32, 64, 128]


@pytest.mark.parametrize(
    "name, shards, expected",
    [("reference", 1, 20), ("reference", 3, 21), ("bgmv", 1, 32), ("bgmv", 2, 32), ("bgmv", 4, 64)],
)
def test_a_split_rank_dim_gives_each_device_an_equal_part_the_kernels_take(name, shards, expected):
    """Max rank 20: the reference pads it to a multiple of the devices, the Pallas
    backends give every device a power of two of at least 16 rank rows."""
    assert make_backend(name).rank_dim(20, shards) == expected


def test_kernels_refuse_rank_rows_split_in_three():
    """3 × 16 rows is no power of two, which the expand half reads whole."""
    with pytest.raises(ConfigError, match=r"lora_backend='bgmv'.*tensor=3 devices.*'mbgmv'"):
        make_backend("bgmv").rank_dim(20, 3)


@pytest.mark.parametrize("name", ["bgmv", "mbgmv"])
def test_compiled_prefill_takes_the_reference_where_triton_dots_cannot(name):
    """q_proj's in (24) is no multiple of 16: a compiled backend prefills it with the
    jnp reference (which runs on any host), and gets the loop's answer."""
    backend, rng = BACKENDS[name](interpret=False), np.random.default_rng(3)
    adapters = [_adapter(rng, rank) for rank in RANKS]
    weights = backend.allocate(
        num_layers=LAYERS, num_slots=SLOTS, max_rank=MAX_RANK, shapes=SHAPES, dtype="float32"
    )
    for slot, tensors in enumerate(adapters):
        weights = _install(backend, weights, slot, tensors, "float32")
    y, x = _activations(9, "q_proj", 4, "float32")
    segments = Segments(slot=jnp.array([3, -1, 0]), start=jnp.array([0, 4, 5, 9]))
    out = backend.sgmv(weights, "q_proj", jnp.int32(2), x, y, segments)
    expected = _naive(adapters, "q_proj", 2, y, x, [3] * 4 + [-1] + [0] * 4)
    assert_close(out, expected, "float32", "float32", scope="op")
