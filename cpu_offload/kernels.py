"""The CPU LoRA kernel: x @ A @ B for a range of rows, fp32, as two direct BLAS sgemm calls.

One call runs on one core: parallelism comes from the pool, which gives each worker
process its own rows (CaraServe §4.2, profiling-guided parallelization: one process
per core) and starts it with one BLAS thread, or, where the device is the CPU, from
the pool's `team.Team`, which splits the rows over threads of the calling process.

Both products are single-precision GEMMs of OpenBLAS (SciPy's, the library Numba's
own `np.dot` calls), made directly from the compiled function through its Fortran
`sgemm` symbol, so that nothing is allocated but the tiny [rows, rank] product x·A and
nothing is copied: the second product is written straight into the caller's output
columns, whatever its row stride (BLAS's leading dimension), where `np.dot` wrote a
temporary that was then copied into the strided columns. Measured on this project's
2-core EPYC (bench/results/2026-11-25-cpu-offload.md): as fast as PyTorch's MKL
`x @ A @ B` on one thread at ranks 16-64 (0.94-1.08x), 2-2.9x faster at rank 8 (where
MKL takes a slow path), 1.1-1.9x faster than the `np.dot` version. Not taken, measured
first: a fused Numba loop (x·A of a block of rows, then its ·B, with fastmath) ran
2-5x slower than the two sgemm calls, and fusing saves little since x·A is only
[rows, rank]; the transposed orientation of the two calls ran 1.1-1.4x slower.
OpenBLAS writes rows 4 KiB apart slowly at small ranks, which the pool avoids by
padding its output rows (`protocol.out_stride`).

`lora_task` runs every job of one worker's task in one compiled call (the pool's
worker loop used to create numpy views and call the kernel once per job from Python).

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
    device's host threads need (measured: 0.11 CPU-seconds in the half second after
    ten calls). SciPy's OpenBLAS is process-wide: nothing else in the engine's process
    relies on its threads. Best effort: a SciPy on another BLAS is left as it is.
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
    their CPUs), and the CPU LoRA kernel then runs at that core's speed (on a Zen 5,
    Haswell's AVX2 kernels take about 1.6x as long as its own AVX-512 ones at rank 16:
    bench/results/2026-11-28-cpu-offload-native.md). The engine leaves the environment
    as it finds it; benchmarks record this."""
    corename = _openblas_function("get_corename")
    if corename is None:
        return "unknown"
    corename.restype = ctypes.c_char_p
    return corename().decode()


_NO_TRANSPOSE, _TRANSPOSE = 78, 84  # ord("N"), ord("T")

# The second product, xa @ B, in blocks of rows whose output takes about this many bytes.
# OpenBLAS's sgemm with beta = 0 first zeroes all of C in a pass of its own, then reads
# and writes it again: over a whole output larger than the core's L2 (3 MiB at 512 rows
# of 1536 columns) those are passes over memory; block by block they stay in the cache.
# Each call repacks B (rank x out), so blocks are only taken where they hold at least
# twice the rank's rows (`_row_block`). On the Intel VM of 2026-11-29, one thread
# (bench.cpu_offload, against torch's x @ A @ B on MKL): 512 x 16 x 1536 548 -> 364 µs
# (torch 361, 359), 512 x 8 x 1536 462 -> 348 (343, 352), 128 x 16 x 1536 129 -> 90 (127,
# 119), 512 x 16 x 576 279 -> 246 (250, 249); the outputs were equal bit for bit.
OUT_BLOCK_BYTES = 192 << 10


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
def _row_block(rows, rank, n_out):  # pragma: no cover - compiled
    """Rows of xa @ B a call computes: OUT_BLOCK_BYTES of output, unless that is fewer
    than twice the rank's rows (then repacking B each block costs more than it saves)."""
    block = OUT_BLOCK_BYTES // (4 * n_out)
    return block if block >= 2 * rank else rows


@njit(cache=True, nogil=True)
def _product(x, a, b, out):  # pragma: no cover - compiled
    """out = (x @ a) @ b, with out's row stride as BLAS's leading dimension.

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
    sgemm(False, rank, rows, fan_in, a, rank, x, fan_in, 0.0, xa, rank)
    block = _row_block(rows, rank, n_out)
    for start in range(0, rows, block):
        end = min(start + block, rows)
        sgemm(False, n_out, end - start, rank, b, n_out, xa[start:end], rank, 0.0, out[start:], ldc)


@njit(
    void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, :]),
    cache=True,
    nogil=True,
)
def lora_rows(x, a, b, out):  # pragma: no cover - compiled
    """Semantics: out[t] = (x[t] @ a) @ b for every row t (overwrites out).

    x:   f32[rows, in], C-contiguous (a row range of the input region)
    a:   f32[in, rank], C-contiguous (read in place from the arena)
    b:   f32[rank, out_features], C-contiguous, scaling already folded in
    out: f32[rows, out_features], unit column stride, any row stride (columns of the
         output region)

    x @ a is rounded to fp32 before @ b, as the device kernels round it to x.dtype.
    """
    _product(x, a, b, out)


@njit(cache=True, nogil=True)
def _job(arena, jobs, j, fan_in):  # pragma: no cover - compiled
    """Job j of a task: its A [in, rank] and B [rank, out] (views of the arena) and the
    first of its output columns."""
    a_start, b_start = jobs[j, 0] // 4, jobs[j, 1] // 4
    rank, n_out = jobs[j, 2], jobs[j, 3]
    a = arena[a_start : a_start + fan_in * rank].reshape((fan_in, rank))
    b = arena[b_start : b_start + rank * n_out].reshape((rank, n_out))
    return a, b, jobs[j, 4]


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
    jobs:  i64[n_jobs, 5]: a_offset, b_offset (bytes into the arena, multiples
           of 4: A [in, rank] and B [rank, out] row-major), rank, out_features, out_column
    """
    for j in range(jobs.shape[0]):
        a, b, column = _job(arena, jobs, j, x.shape[1])
        _product(x, a, b, y[:, column : column + b.shape[1]])
