"""The one tolerance policy of the test suite.

`tolerances(in_dtype, out_dtype, scope)` gives (atol, rtol) for comparing a result
computed in `in_dtype` (the serving or kernel input dtype) and returned in
`out_dtype` against an fp32 reference. `scope` says what produced it: "op" for one
kernel or layer, "model" for a whole model's logits. Callers assert the output
dtype first, then the values (`assert_close` does both).

Model logits, fp32 serving vs PyTorch fp32: the issue's bound, max-abs <= 1e-3. Two
fp32 implementations of a 30-layer model differ only in summation order; on SmolLM2
we measured max-abs 2.7e-5 to 1.5e-4 (logits of magnitude 20-35), so 1e-3 leaves a
margin without hiding bugs: a wrong RoPE layout or norm moves logits by whole units.

Model logits, bf16 serving vs PyTorch fp32: bf16 weights and activations through 30
layers; we measured max-abs 0.23 to 0.67 on SmolLM2 (3% of the logit range), so the
bound is 1.0 absolute. Tests at this scope also check that the top tokens agree.

One LoRA op (x @ A @ B for a row), fp32 against the fp32 loop reference: only the
summation order differs, over at most a few thousand terms of size ~1: 1e-5. bf16
inputs: x @ A is rounded to bf16 before @ B (as PEFT's two layers do), one bf16
rounding (2^-8 relative) of values ~1 summed over the rank: 2e-2 absolute and
relative.

A kernel's first half alone (x @ A, returned in fp32 before any rounding), bf16
inputs: they are exact in fp32, so only the summation order differs, as in fp32.
"""

from __future__ import annotations

import numpy as np

_POLICY = {
    # (scope, in, out): (atol, rtol)
    ("model", "float32", "float32"): (1e-3, 0.0),
    ("model", "bfloat16", "float32"): (1.0, 0.0),
    ("op", "float32", "float32"): (1e-5, 1e-5),
    ("op", "bfloat16", "bfloat16"): (2e-2, 2e-2),
    ("op", "bfloat16", "float32"): (1e-5, 1e-5),
}


def tolerances(in_dtype, out_dtype, scope: str) -> tuple[float, float]:
    key = (scope, np.dtype(in_dtype).name, np.dtype(out_dtype).name)
    if key not in _POLICY:
        raise KeyError(f"no tolerance for {key}; add it to tests/tolerances.py")
    return _POLICY[key]


def assert_close(actual, expected, in_dtype, out_dtype, *, scope: str) -> None:
    actual = np.asarray(actual)
    assert actual.dtype == np.dtype(out_dtype), f"dtype {actual.dtype}, expected {out_dtype}"
    atol, rtol = tolerances(in_dtype, out_dtype, scope)
    np.testing.assert_allclose(
        actual.astype(np.float32), np.asarray(expected, np.float32), atol=atol, rtol=rtol
    )
