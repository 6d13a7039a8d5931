"""The CPU LoRA kernel: x @ A @ B for a range of rows, fp32, as two direct BLAS products.

One call runs on one core: parallelism comes from the pool, which gives each worker
process its own rows (CaraServe §4.2, profiling-guided parallelization: one process
per core) and starts it with one BLAS thread, or, where the device is the CPU, from
the pool's `team.Team`, which splits the rows over threads of the calling process.

Both products are single-precision GEMMs of OpenBLAS (SciPy's, the library Numba's
own `np.dot` calls), made directly from the compiled function through its Fortran
`sgemm` symbol, so that nothing is allocated but the tiny [rows, rank] product x·A and
nothing is copied: the second product is written straight into the caller's output
columns, whatever its row stride (BLAS's leading dimension), where `np.dot` writes a
temporary that must then be copied into the strided columns. On one thread this is as
fast as PyTorch's MKL `x @ A @ B` at ranks 16-64, two to three times as fast at rank 8
(where MKL takes a slow path), and faster than the `np.dot` form. Rejected: a fused
Numba loop (x·A of a block of rows, then its ·B, with fastmath) was several times
slower than the two sgemm calls, and fusing saves little since x·A is only
[rows, rank]; the transposed orientation of the two calls was slower too.
OpenBLAS writes rows 4 KiB apart slowly at small ranks, which the pool avoids by
padding its output rows (`protocol.out_stride`).

`lora_task` runs every job of one worker's task in one compiled call, not a Python loop
that makes numpy views and calls the kernel once per job.

The signatures are fixed, so the kernels are compiled (or loaded from Numba's on-disk
cache: the BLAS symbol is resolved by name when the cached code is linked) once at
import, never on the serving path.
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import binding
from numba import float32, int64, njit, types, void
from numba.extending import get_cython_function_address

# Fortran sgemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): every
# argument by pointer. Registered under our own name so that cached code links to it.
_SGEMM_ADDRESS = get_cython_function_address("scipy.linalg.cython_blas", "sgemm")
binding.add_symbol("jlora_sgemm", _SGEMM_ADDRESS)
_sgemm = types.ExternalFunction("jlora_sgemm", types.void(*([types.voidptr] * 13)))
_SET_THREADS = ("scipy_openblas_set_num_threads", "openblas_set_num_threads")


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _openblas() -> ctypes.CDLL | None:
    """The OpenBLAS library behind `sgemm` (SciPy's), or None where SciPy runs another
    BLAS or it cannot be found."""
    try:
        libc = ctypes.CDLL(None)
        libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        info = _DlInfo()
        if not libc.dladdr(ctypes.c_void_p(_SGEMM_ADDRESS), ctypes.byref(info)):
            return None
        return ctypes.CDLL(info.dli_fname.decode())  # dlsym searches its dependencies
    except OSError:
        return None


def _openblas_function(suffix: str):
    """OpenBLAS's `[scipy_]openblas_<suffix>`, or None."""
    library = _openblas()
    names = (f"scipy_openblas_{suffix}", f"openblas_{suffix}")
    return next((getattr(library, n) for n in names if library and hasattr(library, n)), None)


def one_blas_thread() -> bool:
    """Give the OpenBLAS behind `sgemm` one thread in this process; True if it could.

    Workers start with one (OPENBLAS_NUM_THREADS=1 in their environment); the calling
    process, which computes a late worker's or a dead worker's share and the start-up
    profile, has already loaded OpenBLAS with a thread per core, and OpenBLAS's helper
    threads spin for about 0.1 s after every call, on the cores the workers and the
    device's host threads need (ten calls leave about 0.1 CPU-seconds of spinning in
    the next half second). SciPy's OpenBLAS is process-wide: nothing else in the
    engine's process relies on its threads. Best effort: a SciPy on another BLAS is left
    as it is.
    """
    setter = _openblas_function("set_num_threads")
    if setter is None:
        return False
    setter(1)
    return True


def blas_core() -> str:
    """The kernels OpenBLAS runs `sgemm` with ("SkylakeX", "Haswell", ...; "unknown").

    OpenBLAS picks them for the CPU at load, unless OPENBLAS_CORETYPE names others: some
    machines set it to an older core for every process (older builds miscompute on
    their CPUs), and the CPU LoRA kernel then runs at that core's speed (on an AVX-512
    CPU, Haswell's AVX2 kernels take about 1.6x as long as its own at rank 16). The
    engine leaves the environment as it finds it; benchmarks record this."""
    corename = _openblas_function("get_corename")
    if corename is None:
        return "unknown"
    corename.restype = ctypes.c_char_p
    return corename().decode()


_NO_TRANSPOSE, _TRANSPOSE = 78, 84  # ord("N"), ord("T")

# OpenBLAS's SkylakeX kernels, which its Cooperlake and SapphireRapids cores run too,
# take a path of their own for a small product: a non-transposed sgemm of at most 100^3
# multiply-adds (m * n * k) runs without packing A and B into panels first (its
# `sgemm_small_kernel_permit_skylakex.c`). Both of the kernel's products are long in
# rows and short in the rest (x @ A: rank x in a row; xa @ B: out x rank), so they are
# made in blocks of rows that each take that path (`rows_per_call`), of at most 256 KiB
# of output: past that the path slows down (xa @ B at rank 8 into 1536 columns, 512
# rows: blocks of 40 or 56 rows take about two thirds of one call's time, blocks of 64
# about as long as one call). On one thread at 512 rows, each of SmolLM2's products in
# blocks takes 0.65-0.8x its time in one call, as fast as torch's MKL or faster. Other
# cores have no such path: with OPENBLAS_CORETYPE=Haswell every block size was slower
# than one call (by about a third for 16 -> 1536 in 32-row blocks), so there each
# product is one call.
SMALL_PRODUCT_CORES = frozenset({"SkylakeX", "Cooperlake", "SapphireRapids"})
SMALL_PRODUCT_MADDS = 100**3
SMALL_PRODUCT_OUT_BYTES = 256 << 10
_ROW_ALIGN = 8  # 10-row blocks ran 5-15% slower than 8-row ones (rank 64, 1536 wide)
_MIN_ROWS = 16  # blocks of 8 (rank 64 into 1536 columns) were as often slower as faster
_CORE = blas_core()  # OPENBLAS_CORETYPE is read once, when OpenBLAS loads


@njit(int64(int64, int64), cache=True)
def block_rows(width, depth):  # pragma: no cover - compiled
    """Rows per sgemm call on the small-product path, for a product whose row is `width`
    outputs of `depth` multiply-adds each: the most, a multiple of 8, within 100^3
    multiply-adds and 256 KiB of output a call; 0 (all rows in one call) where not even
    16 rows fit."""
    rows = min(SMALL_PRODUCT_MADDS // max(width * depth, 1), SMALL_PRODUCT_OUT_BYTES // (4 * width))
    rows = rows // _ROW_ALIGN * _ROW_ALIGN
    return rows if rows >= _MIN_ROWS else 0


def small_product_path(core: str | None = None) -> bool:
    """Whether OpenBLAS's `core` (this process's, by default) has the small-product path."""
    return (core or _CORE) in SMALL_PRODUCT_CORES


def rows_per_call(width: int, depth: int, core: str | None = None) -> int:
    """Rows per sgemm call of a product whose row is `width` outputs of `depth`
    multiply-adds each, on OpenBLAS's `core` (this process's, by default): `block_rows`
    where the core has the small-product path, else 0 (one call)."""
    return block_rows(width, depth) if small_product_path(core) else 0


@njit(inline="always")
def sgemm(transpose_a, m, n, k, a, lda, b, ldb, beta, c, ldc):  # pragma: no cover - compiled
    """Column-major C [m, n] = op(A) [m, k] @ B [k, n] + beta * C in fp32, by OpenBLAS's
    sgemm, op(A) = A^T where `transpose_a`; a, b, c are arrays read and written at their
    data pointers, with the leading dimensions given. A row-major P [r, s] is column-major
    P^T [s, r], leading dimension s (its row stride)."""
    d = np.array([m, n, k, lda, ldb, ldc], np.int32)
    scalars = np.array([1.0, beta], np.float32)
    trans = np.array([_TRANSPOSE if transpose_a else _NO_TRANSPOSE, _NO_TRANSPOSE], np.uint8)
    _sgemm(trans[0:].ctypes, trans[1:].ctypes, d[0:].ctypes, d[1:].ctypes, d[2:].ctypes,
           scalars[0:].ctypes, a.ctypes, d[3:].ctypes, b.ctypes, d[4:].ctypes,
           scalars[1:].ctypes, c.ctypes, d[5:].ctypes)  # fmt: skip


@njit(inline="always")
def sgemm_blocks(m, n, k, a, lda, b, ldb, beta, c, ldc, rows):  # pragma: no cover - compiled
    """sgemm(False, m, n, k, ...) as calls of `rows` columns of C (rows of the row-major
    product) each; all at once where `rows` is 0."""
    step = rows if rows > 0 else max(n, 1)
    for start in range(0, n, step):
        width = min(step, n - start)
        sgemm(False, m, width, k, a, lda, b[start:], ldb, beta, c[start:], ldc)


@njit(
    void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, :], int64, int64),
    cache=True,
    nogil=True,
)
def _product(x, a, b, out, x_rows, out_rows):  # pragma: no cover - compiled
    """out = (x @ a) @ b, with out's row stride as BLAS's leading dimension, each product
    in calls of `x_rows` and `out_rows` rows (`rows_per_call`; 0: one call).

    Row-major P [m, n] is column-major P^T, so x @ a is sgemm(m=rank, n=rows, k=in,
    A=a, B=x) and xa @ b is sgemm(m=out_features, n=rows, k=rank, A=b, B=xa, C=out).
    """
    rows, fan_in = x.shape
    rank, n_out = b.shape
    if rows == 0:
        return
    if out.shape[0] != rows or out.shape[1] != n_out or a.shape[0] != fan_in or a.shape[1] != rank:
        raise ValueError("lora_rows: shapes do not match (x [rows, in], a [in, r], b [r, out])")
    if out.strides[1] != 4 or (rows > 1 and out.strides[0] < 4 * n_out):
        raise ValueError("lora_rows: out must have unit column stride and whole rows")
    ldc = out.strides[0] // 4 if rows > 1 else n_out
    xa = np.empty((rows, rank), np.float32)  # [rows, rank]
    sgemm_blocks(rank, rows, fan_in, a, rank, x, fan_in, 0.0, xa, rank, x_rows)
    sgemm_blocks(n_out, rows, rank, b, n_out, xa, rank, 0.0, out, ldc, out_rows)


def lora_rows(x: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """Semantics: out[t] = (x[t] @ a) @ b for every row t (overwrites out).

    x:   f32[rows, in], C-contiguous (a row range of the input region)
    a:   f32[in, rank], C-contiguous (read in place from the arena)
    b:   f32[rank, out_features], C-contiguous, scaling already folded in
    out: f32[rows, out_features], unit column stride, any row stride (columns of the
         output region)

    x @ a is rounded to fp32 before @ b, as the device kernels round it to x.dtype. Each
    product is made in calls of `rows_per_call` rows, as `lora_task` makes it.
    """
    fan_in, rank = a.shape
    _product(x, a, b, out, rows_per_call(rank, fan_in), rows_per_call(b.shape[1], rank))


@njit(cache=True, nogil=True)
def _job(arena, jobs, j, fan_in):  # pragma: no cover - compiled
    """Job j of a task: its A [in, rank] and B [rank, out] (views of the arena), the
    first of its output columns, and its products' rows per sgemm call."""
    a_start, b_start = jobs[j, 0] // 4, jobs[j, 1] // 4
    rank, n_out = jobs[j, 2], jobs[j, 3]
    a = arena[a_start : a_start + fan_in * rank].reshape((fan_in, rank))
    b = arena[b_start : b_start + rank * n_out].reshape((rank, n_out))
    return a, b, jobs[j, 4], jobs[j, 5], jobs[j, 6]


@njit(
    void(float32[::1], float32[:, ::1], float32[:, :], int64[:, ::1]),
    cache=True,
    nogil=True,
)
def lora_task(arena, x, y, jobs):  # pragma: no cover - compiled
    """Semantics: for each job j, y[:, c_j : c_j + out_j] = x @ A_j @ B_j.

    arena: f32[arena bytes / 4], the host store's segment (A and B read in place)
    x:     f32[rows, in], C-contiguous: the task's rows of the input region
    y:     f32[rows, out_total], unit column stride: the same rows of the output
           region (`protocol.out_stride` apart); columns no job covers are left untouched
    jobs:  i64[n_jobs, protocol.JOB_WORDS]: a_offset, b_offset (bytes into the arena,
           multiples of 4: A [in, rank] and B [rank, out] row-major), rank, out_features,
           out_column, and the rows per sgemm call of x @ A and of xa @ B
           (`rows_per_call`; 0: one call)
    """
    for j in range(jobs.shape[0]):
        a, b, column, x_rows, out_rows = _job(arena, jobs, j, x.shape[1])
        _product(x, a, b, y[:, column : column + b.shape[1]], x_rows, out_rows)
