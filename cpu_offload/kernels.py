"""The CPU LoRA kernel: x @ A @ B for a range of rows, compiled by Numba, fp32 throughout.

One call runs on one core (no Numba threading): parallelism comes from the pool,
which gives each worker process its own rows (CaraServe's one process per core).
The signature is fixed, so the kernel is compiled (or loaded from Numba's on-disk
cache) once at import, never on the serving path.
"""

from __future__ import annotations

import numpy as np
from numba import float32, njit, void

_SIGNATURE = void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, :])


@njit(_SIGNATURE, cache=True, fastmath=False, nogil=True)
def lora_rows(x, a, b, out):  # pragma: no cover - compiled
    """Semantics: out[t] = (x[t] @ a) @ b for every row t (overwrites out).

    x:   f32[rows, in], C-contiguous (a row range of the input region)
    a:   f32[in, rank], C-contiguous (read in place from the arena)
    b:   f32[rank, out_features], C-contiguous, scaling already folded in
    out: f32[rows, out_features], any strides (columns of the output region)

    Both products accumulate in fp32 in a fixed order (fastmath off), with the
    innermost loops running over contiguous memory so LLVM vectorizes them.
    """
    rows, in_features = x.shape
    rank, out_features = b.shape
    h = np.empty(rank, np.float32)  # [rank]
    acc = np.empty(out_features, np.float32)  # [out_features]
    for t in range(rows):
        h[:] = 0.0
        for i in range(in_features):
            xi = x[t, i]
            for j in range(rank):
                h[j] += xi * a[i, j]
        acc[:] = 0.0
        for j in range(rank):
            hj = h[j]
            for o in range(out_features):
                acc[o] += hj * b[j, o]
        for o in range(out_features):
            out[t, o] = acc[o]
