"""The adapter mixes every LoRA kernel test sweeps (after punica's tests/test_sgmv.py).

Adapters are plain fp32 numpy (A [L, in, r], B [L, r, out]); `stacked` and `paged`
lay them out as the kernels read them (pallas_kernels/common.py: rank rows), and
`naive` is the semantics written out as a Python loop, one row at a time in fp32.

Layouts are filled so that ignoring the rank is caught: rank rows at or beyond a
slot's rank hold NaN, and so do pool pages no slot owns.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_close

POPULARITY = ("identical", "distinct", "uniform", "zipf", "skewed")
BATCHES = (1, 2, 3, 7, 16, 133)
DTYPES = ("float32", "bfloat16")
# Slot ranks: mixed, and not powers of two; the rank dimension R is padded to 16 or 64.
MIXED_RANKS = (16, 5, 1, 12, 8, 3, 16, 7)
WIDE_RANKS = (64, 8, 33, 16)

Adapter = tuple[np.ndarray, np.ndarray]  # (A [L, in, r], B [L, r, out]), fp32


def make_adapters(rng, ranks, fan_in: int, fan_out: int, layers: int = 2) -> list[Adapter]:
    """Scaled like trained adapters: x @ A and x @ A @ B have entries of size ~1."""
    return [
        (
            (rng.standard_normal((layers, fan_in, rank)) / np.sqrt(fan_in)).astype(np.float32),
            (rng.standard_normal((layers, rank, fan_out)) / np.sqrt(max(rank, 1))).astype(
                np.float32
            ),
        )
        for rank in ranks
    ]


def row_slots(popularity: str, batch: int, num_slots: int, rng, base_every: int = 4) -> np.ndarray:
    """i32[batch]: each row's slot under an adapter popularity; every `base_every`-th
    row (counting from 1) has none (-1). `base_every=0` keeps every row adapted."""
    if popularity == "identical":
        slots = np.full(batch, num_slots - 1)
    elif popularity == "distinct":
        slots = np.arange(batch) % num_slots
    elif popularity == "uniform":
        slots = rng.integers(0, num_slots, batch)
    elif popularity == "zipf":
        slots = np.minimum(rng.zipf(1.5, batch) - 1, num_slots - 1)
    elif popularity == "skewed":  # 90% of rows on one adapter, the rest spread out
        slots = np.where(rng.random(batch) < 0.9, 0, rng.integers(0, num_slots, batch))
    else:
        raise ValueError(f"popularity={popularity!r}")
    if base_every:
        slots[base_every - 1 :: base_every] = -1
    return slots.astype(np.int32)


def segments_of(slots_by_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows sorted by adapter -> (seg_slot i32[G], seg_start i32[G + 1]) of their runs."""
    change = np.flatnonzero(np.diff(slots_by_row)) + 1
    starts = np.concatenate([[0], change, [len(slots_by_row)]]).astype(np.int32)
    return slots_by_row[starts[:-1]].astype(np.int32), starts


def rounded(array, dtype) -> np.ndarray:
    """`array` as stored in `dtype`, back in fp32."""
    return np.asarray(jnp.asarray(array, dtype), np.float32)


def naive(y, x, adapters: list[Adapter], slots_by_row, layer: int, dtype) -> np.ndarray:
    """y[s] += (x[s] @ A) @ B for the row's adapter, fp32, one row at a time.

    Weights, x and y are taken as stored in `dtype`; x @ A is rounded to `dtype` as the
    kernels do (common.py), so a bf16 kernel is compared with the same arithmetic.
    """
    out = rounded(y, dtype).copy()
    xs = rounded(x, dtype)
    for row, slot in enumerate(slots_by_row):
        if slot < 0:
            continue
        a, b = (rounded(w[layer], dtype) for w in adapters[slot])
        shrunk = rounded(xs[row] @ a, dtype)
        out[row] = out[row] + shrunk @ b
    return out


def naive_shrink(x, adapters: list[Adapter], slots_by_row, layer: int, dtype, rank_dim: int):
    """The kernels' first half: v[s, :r] = x[s] @ A of the row's adapter in fp32 (r its
    rank), zero past r and on rows without an adapter; f32[S, rank_dim]."""
    xs = rounded(x, dtype)
    v = np.zeros((len(slots_by_row), rank_dim), np.float32)
    for row, slot in enumerate(slots_by_row):
        if slot >= 0:
            a = rounded(adapters[slot][0][layer], dtype)
            v[row, : a.shape[1]] = xs[row] @ a
    return v


def stacked(adapters: list[Adapter], rank_dim: int, dtype):
    """BGMV layout: a [L, N, R, in] (rank rows of A^T), b [L, N, R, out], ranks i32[N].
    Rows at or beyond a slot's rank are NaN."""
    layers, fan_in, _ = adapters[0][0].shape
    fan_out = adapters[0][1].shape[-1]
    a = np.full((layers, len(adapters), rank_dim, fan_in), np.nan, np.float32)
    b = np.full((layers, len(adapters), rank_dim, fan_out), np.nan, np.float32)
    for slot, (lora_a, lora_b) in enumerate(adapters):
        rank = lora_a.shape[-1]
        a[:, slot, :rank] = lora_a.transpose(0, 2, 1)
        b[:, slot, :rank] = lora_b
    ranks = np.array([w[0].shape[-1] for w in adapters], np.int32)
    return jnp.asarray(a, dtype), jnp.asarray(b, dtype), jnp.asarray(ranks)


def paged(adapters: list[Adapter], rank_dim: int, rng, dtype, spare_pages: int = 5):
    """MBGMV layout: a_pool [L, P, in], b_pool [L, P, out], pages i32[N, R], ranks i32[N].

    Each slot owns exactly its rank's pages, scattered through the pool; its page-table
    entries beyond the rank point at random pages (another slot's, or NaN spares).
    """
    layers, fan_in, _ = adapters[0][0].shape
    fan_out = adapters[0][1].shape[-1]
    ranks = [w[0].shape[-1] for w in adapters]
    num_pages = sum(ranks) + spare_pages
    order = rng.permutation(num_pages)
    a = np.full((layers, num_pages, fan_in), np.nan, np.float32)
    b = np.full((layers, num_pages, fan_out), np.nan, np.float32)
    pages = rng.integers(0, num_pages, (len(adapters), rank_dim)).astype(np.int32)
    used = 0
    for slot, (lora_a, lora_b) in enumerate(adapters):
        rank = ranks[slot]
        own = order[used : used + rank]
        used += rank
        pages[slot, :rank] = own
        a[:, own] = lora_a.transpose(0, 2, 1)
        b[:, own] = lora_b
    return (
        jnp.asarray(a, dtype),
        jnp.asarray(b, dtype),
        jnp.asarray(pages),
        jnp.asarray(np.array(ranks, np.int32)),
    )


def wider_rows(pool, extra: int):
    """A pool [L, P, width] with `extra` NaN values after each row's: the KV cache's pages
    seen as rank rows (jlora/model/lora/pallas.py), whose rows are wider than the
    projection; a kernel must read each row's first values alone."""
    return jnp.pad(pool, ((0, 0), (0, 0), (0, extra)), constant_values=np.nan)


def check_wider_pool_rows(kernel, reference, args, slots_by_row, *, interpret: bool) -> None:
    """A pooled kernel's args (y, x, a_pool, b_pool, ...) with each pool row 40 NaN values
    wider than x and y (`wider_rows`): checked against the reference (`check_kernel`),
    and the exact pools' output bit for bit."""
    a_pool, b_pool = (wider_rows(pool, 40) for pool in args[2:4])
    wide = (*args[:2], a_pool, b_pool, *args[4:])
    out = check_kernel(kernel, reference, wide, slots_by_row, interpret=interpret)
    exact = kernel(*args, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(exact))


def activations(rng, rows: int, fan_in: int, fan_out: int, dtype):
    """(y [rows, out], x [rows, in]) in `dtype`, entries of size ~1."""
    y = jnp.asarray(rng.standard_normal((rows, fan_out)), dtype)
    x = jnp.asarray(rng.standard_normal((rows, fan_in)), dtype)
    return y, x


def assert_untouched(before, after, slots_by_row) -> None:
    """Rows without an adapter are bit-identical (compared as raw bits)."""
    base = np.asarray(slots_by_row) < 0
    np.testing.assert_array_equal(_bits(after)[base], _bits(before)[base])


def _bits(array) -> np.ndarray:
    return np.asarray(array).view(np.uint16 if array.dtype == jnp.bfloat16 else np.uint32)


def check_kernel(kernel, reference, args, slots_by_row, *, interpret: bool):
    """kernel(*args) against reference(*args) under the tolerance policy (scope "op",
    dtype first), rows without an adapter bit-identical; returns the kernel's output."""
    y, x = args[0], args[1]
    out = kernel(*args, interpret=interpret)
    assert_close(out, reference(*args), x.dtype, y.dtype, scope="op")
    assert_untouched(y, out, slots_by_row)
    return out


def triton_calls(kernel, shapes) -> int:
    """How many Triton kernels `kernel(*args, interpret=False)` lowers to for CUDA, on
    arguments of `shapes` [(shape, dtype), ...]. Lowering runs on any host: it applies
    the Triton rules (power-of-two arrays, supported primitives) without a GPU."""
    import jax

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    with _abstract_gpu():
        traced = jax.jit(lambda *a: kernel(*a, interpret=False)).trace(*args)
        lowered = traced.lower(lowering_platforms=("cuda",))
    return lowered.as_text().count("__gpu$xla.gpu.triton")


def _abstract_gpu():
    """From JAX 0.11 a Triton lowering reads its target from the device, and off a GPU
    from an abstract mesh's abstract device (an H100 here); before, it had a default."""
    import contextlib

    import jax

    if not hasattr(jax.sharding, "AbstractDevice") or jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


# Argument errors of the pool kernels (MBGMV, SGMV), whose arguments start with
# (y, x, a_pool, b_pool): case -> (the argument the error names, its position, change).
POOL_KERNEL_ERRORS = {
    "x dtype float16": ("x", 1, lambda x: x.astype(jnp.float16)),
    "y dtype differs from x": ("y", 0, lambda y: y.astype(jnp.bfloat16)),
    "y rows differ from x": ("y", 0, lambda y: y[:-1]),
    "a_pool in differs from x": ("a_pool", 2, lambda a: a[..., :-1]),
    "a_pool dtype differs from x": ("a_pool", 2, lambda a: a.astype(jnp.bfloat16)),
    "b_pool pages differ from a_pool": ("b_pool", 3, lambda b: b[:, :-1]),
    "b_pool out differs from y": ("b_pool", 3, lambda b: b[..., :-1]),
    "b_pool dtype differs from x": ("b_pool", 3, lambda b: b.astype(jnp.bfloat16)),
}


def with_changed(args, position: int, change) -> tuple:
    """`args` with args[position] replaced by change(args[position])."""
    changed = list(args)
    changed[position] = change(changed[position])
    return tuple(changed)


def gpu_or_skip(interpret: bool) -> None:
    """The compiled classes need a GPU; the interpret-mode subclasses run anywhere."""
    import jax

    if not interpret and jax.default_backend() != "gpu":
        pytest.skip("compiled Pallas kernels need a GPU (the interpret-mode class runs here)")
