"""The one tolerance policy of the test suite.

`tolerances(in_dtype, out_dtype)` gives (atol, rtol) for comparing a result computed
in `in_dtype` (the serving / kernel input dtype) and returned in `out_dtype` against
an fp32 reference. Callers assert the output dtype first, then the values.

Model logits (fp32 serving vs PyTorch fp32): the issue's bound, max-abs <= 1e-3. Two
fp32 implementations of a 30-layer model differ only in summation order; we measured
max-abs ~2e-5 on SmolLM2 logits, so 1e-3 leaves a wide margin without hiding bugs (a
wrong RoPE layout or norm shifts logits by whole units).
"""

from __future__ import annotations

import numpy as np

_POLICY = {
    # (in, out): (atol, rtol)
    ("float32", "float32"): (1e-3, 0.0),
    ("bfloat16", "float32"): (5e-2, 2e-2),
    ("bfloat16", "bfloat16"): (6e-2, 2e-2),
}


def tolerances(in_dtype, out_dtype) -> tuple[float, float]:
    key = (np.dtype(in_dtype).name, np.dtype(out_dtype).name)
    if key not in _POLICY:
        raise KeyError(f"no tolerance for {key}; add it to tests/tolerances.py")
    return _POLICY[key]


def assert_close(actual, expected, in_dtype, out_dtype=None) -> None:
    actual = np.asarray(actual)
    out_dtype = np.dtype(out_dtype or actual.dtype)
    assert actual.dtype == out_dtype, f"dtype {actual.dtype}, expected {out_dtype}"
    atol, rtol = tolerances(in_dtype, out_dtype)
    np.testing.assert_allclose(
        actual.astype(np.float32), np.asarray(expected, np.float32), atol=atol, rtol=rtol
    )
