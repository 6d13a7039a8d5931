"""What every LoRA kernel shares: the argument checks, block sizes and GPU lowering.

Layouts. Every kernel reads adapters as *rank rows*: row j of an adapter's A^T
(its j-th column of A, length `in`) and row j of its B (length `out`). A slot is
either a stacked run of R rank rows ([N, R, in], BGMV) or R entries of a page table
into a pool of rank rows ([P, in], MBGMV and SGMV). A stacked layout is a pool whose
page table is `stacked_pages(N, R)`, so the segmented kernel serves both. A pool's
rows may be wider than `in` (or `out`): the kernels read a row's first values, so the
KV cache's pages, viewed as rows of a width that divides them, serve as a pool.

Arithmetic, for every kernel and its reference: x @ A is accumulated in fp32 and
rounded to x.dtype (as PEFT's two Linear layers do), @ B is accumulated in fp32,
added to y in fp32 and rounded to y.dtype once. A row without an adapter (index -1)
is not written: it leaves y bit-identical.

GPU lowering: Triton for all three kernels. They are gathers of small blocks
addressed by per-row indices read inside the kernel (a row's slot, its pages), with
per-row trip counts; Triton lowers such pointer arithmetic and dynamic loops on
Ampere and Hopper alike, while Mosaic GPU targets large TMA/wgmma tiles on Hopper
only. Triton wants every array in the kernel body to have power-of-two sizes: block
sizes come from `pow2_block`, and the rank dimension R must be a power of two.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
RANK_CHUNK = 8  # rank rows read per step of a row's rank loop: at most 7 rows wasted


def pow2_block(dim: int, cap: int) -> int:
    """The largest power of two that divides `dim`, at most `cap` (1 for odd dims)."""
    return min(dim & -dim, cap)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def shrink_parts(fan_in: int, block_in: int) -> int:
    """How many parts of x @ A a decode shrink writes per row, one per `in` block,
    rounded up to a power of two (the expand loads them as one Triton array); the
    parts past the last block are zeros."""
    return 1 << (fan_in // block_in - 1).bit_length()


def summed_parts(parts_ref: Any, start: Any, size: int, dtype: Any) -> jax.Array:
    """Rank entries [start, start + size) of one row's x @ A, from a decode shrink's parts
    (f32[K, R]) or from v itself ([1, R] in x's dtype): the parts summed in f32 and
    rounded to `dtype` (the arithmetic rule above), returned as f32[size]. The expand
    sums the parts itself, where XLA's reduce was a launch of its own per projection."""
    parts = parts_ref[:, pl.ds(start, size)].astype(jnp.float32)
    return jnp.sum(parts, axis=0).astype(dtype).astype(jnp.float32)


def whole(shape: tuple[int, ...]) -> pl.BlockSpec:
    """A block that is the whole array, the same for every program (indexed inside)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


NUM_WARPS = 4  # per Triton program; `bench.kernels --tune` compares others
NUM_STAGES = 1


def triton_params() -> Any:
    """Compiler parameters that select the Triton lowering on GPU."""
    return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def stacked_pages(num_slots: int, rank: int) -> jax.Array:
    """The page table of a stacked layout [N, R, ...] seen as a pool [N * R, ...]."""
    return jnp.arange(num_slots * rank, dtype=jnp.int32).reshape(num_slots, rank)


class KernelArgumentError(ValueError):
    """A kernel or reference was called with arguments of the wrong shape or dtype."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise KernelArgumentError(message)


def expect_shape(name: str, array: Any, shape: tuple[int | None, ...]) -> None:
    """`array`'s shape matches `shape` (None: any size); the error names the argument."""
    ok = len(array.shape) == len(shape) and all(
        want is None or have == want for have, want in zip(array.shape, shape, strict=True)
    )
    expect(ok, f"{name} has shape {tuple(array.shape)}, expected {_pattern(shape)}")


def expect_dtype(name: str, array: Any, allowed: tuple[Any, ...]) -> None:
    expect(
        jnp.dtype(array.dtype) in [jnp.dtype(d) for d in allowed],
        f"{name} has dtype {jnp.dtype(array.dtype).name}, "
        f"expected one of {[jnp.dtype(d).name for d in allowed]}",
    )


def expect_activations(y: Any, x: Any) -> tuple[int, int, int]:
    """y [rows, out] and x [rows, in] of one float dtype -> (rows, in, out)."""
    expect(len(x.shape) == 2, f"x has shape {tuple(x.shape)}, expected [rows, in]")
    expect_dtype("x", x, FLOAT_DTYPES)
    expect_shape("y", y, (x.shape[0], None))
    expect(y.dtype == x.dtype, f"y has dtype {y.dtype}, expected x's dtype {x.dtype}")
    return x.shape[0], x.shape[1], y.shape[1]


def expect_pool(x: Any, y: Any, a_pool: Any, b_pool: Any) -> None:
    """a_pool [L, P, >= in] and b_pool [L, P, >= out] of rank rows, in x's dtype."""
    expect_pool_rows("a_pool", a_pool, x.shape[1], x.dtype)
    expect_pool_rows("b_pool", b_pool, y.shape[1], x.dtype, a_pool.shape[:2])


def expect_pool_rows(
    name: str, pool: Any, width: int, dtype: Any, lead: tuple[int | None, ...] = (None, None)
) -> None:
    """A pool of rank rows [L, P, W] in `dtype`, W >= width: a row's first `width` values
    are what the kernels read, so a pool may be a wider array viewed as rows (the KV
    cache's pages, jlora/model/lora/pallas.py)."""
    ok = len(pool.shape) == 3 and pool.shape[2] >= width
    expect_shape(name, pool, (*lead, pool.shape[2] if ok else width))
    expect_dtype(name, pool, (dtype,))


def expect_shrink_operands(x: Any, name: str, a: Any, lead: tuple[None, ...]) -> None:
    """A shrink's operands: x [rows, in] of a float dtype, and A (`name`) in x's dtype:
    stacked slots [*lead, in], or a pool of rank rows (lead [L, P]: `expect_pool_rows`)."""
    expect(len(x.shape) == 2, f"x has shape {tuple(x.shape)}, expected [rows, in]")
    expect_dtype("x", x, FLOAT_DTYPES)
    if len(lead) == 2:
        expect_pool_rows(name, a, x.shape[1], x.dtype)
        return
    expect_shape(name, a, (*lead, x.shape[1]))
    expect_dtype(name, a, (x.dtype,))


def expect_expand_operands(
    y: Any, v: Any, name: str, b: Any, lead: tuple[None, ...], rank_dim: int | None = None
) -> None:
    """An expand's operands: y [rows, out] of a float dtype, v [rows, R] and B (`name`)
    in y's dtype. Stacked slots (no `rank_dim`): B [*lead, R, out], R v's. A page pool
    (`rank_dim`, its page table's R): B [*lead, P, >= out] (`expect_pool_rows`)."""
    expect(len(y.shape) == 2, f"y has shape {tuple(y.shape)}, expected [rows, out]")
    expect_dtype("y", y, FLOAT_DTYPES)
    expect_shape("v", v, (y.shape[0], rank_dim))
    expect_dtype("v", v, (y.dtype,))
    if rank_dim:
        expect_pool_rows(name, b, y.shape[1], y.dtype, (*lead, None))
        return
    expect_shape(name, b, (*lead, v.shape[1], y.shape[1]))
    expect_dtype(name, b, (y.dtype,))


def expect_page_table(pages: Any, ranks: Any) -> int:
    """pages i32[N, R] (N >= 1) and ranks i32[N]; returns the rank chunk (see below)."""
    expect_shape("pages", pages, (None, None))
    expect_dtype("pages", pages, (jnp.int32,))
    expect(pages.shape[0] > 0, "pages has no slots (shape [0, R])")
    expect_shape("ranks", ranks, (pages.shape[0],))
    expect_dtype("ranks", ranks, (jnp.int32,))
    return expect_rank_dim("pages", pages.shape[1])


def expect_rank_dim(name: str, rank: int) -> int:
    """Checks that R is a power of two; returns the rank chunk, min(RANK_CHUNK, R)."""
    expect(is_pow2(rank), f"{name} has rank dimension {rank}; it must be a power of two")
    return min(RANK_CHUNK, rank)


def as_layer(layer: Any) -> jax.Array:
    """The layer index as the i32[1] array the kernels read."""
    return jnp.asarray(layer, jnp.int32).reshape(1)


def _pattern(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
