"""Products accumulated in float32, on every backend.

XLA:CPU has no bfloat16 x bfloat16 -> float32 dot (the run fails with "Unsupported
element type for DotThunk::Execute: BF16 x BF16 = F32"), so a bfloat16 engine on a CPU
could not decode. On a CPU, `einsum_f32` widens bfloat16 operands to float32 first: a
product of two bfloat16 numbers is exact in float32, so it computes the same products
with the same float32 accumulation. Elsewhere it is `jnp.einsum` with
`preferred_element_type=float32`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def einsum_f32(spec: str, *operands: jax.Array, **kwargs: Any) -> jax.Array:
    """`jnp.einsum(spec, *operands)` accumulated and returned in float32."""
    if jax.default_backend() == "cpu":
        operands = tuple(
            op.astype(jnp.float32) if op.dtype == jnp.bfloat16 else op for op in operands
        )
    return jnp.einsum(spec, *operands, preferred_element_type=jnp.float32, **kwargs)
