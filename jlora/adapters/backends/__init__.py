"""Batched-LoRA backends: the interface (`base`), plain jnp (`reference`), and the
Pallas kernels (`pallas`: BGMV over stacked slots, MBGMV over a page pool); the
reference and MBGMV may keep their adapters in the KV cache's pages instead (`pooled`)."""

from __future__ import annotations

from jlora.adapters.backends.base import (
    HostTensors,
    KVPagesBackend,
    LoraBackend,
    LoraWeights,
    Payload,
    Segments,
    layer_group,
)
from jlora.adapters.backends.pallas import BgmvBackend, MbgmvBackend, PooledMbgmvBackend
from jlora.adapters.backends.reference import PooledReferenceBackend, ReferenceBackend

__all__ = [
    "BACKENDS",
    "HostTensors",
    "KVPagesBackend",
    "LoraBackend",
    "LoraWeights",
    "POOLED",
    "Payload",
    "Segments",
    "layer_group",
    "make_backend",
]

# Keyed by configs.engine.LORA_BACKENDS (a test checks that the two agree).
BACKENDS: dict[str, type[LoraBackend]] = {
    "reference": ReferenceBackend,
    "bgmv": BgmvBackend,
    "mbgmv": MbgmvBackend,
}


# The backends that can keep their adapters in the KV cache's pages (one device).
POOLED: dict[str, type[KVPagesBackend]] = {
    "reference": PooledReferenceBackend,
    "mbgmv": PooledMbgmvBackend,
}


def make_backend(name: str, page_width: int | None = None) -> LoraBackend:
    """The backend `name`; page_width: where the adapters may live in the KV cache (one
    device), the values a page holds per layer: a backend of POOLED then keeps them
    there (BGMV keeps its stacked slots: backends/pallas.py says why)."""
    if name not in BACKENDS:
        raise ValueError(f"lora_backend={name!r} must be one of {list(BACKENDS)}")
    if page_width and name in POOLED:
        return POOLED[name](page_width)
    return BACKENDS[name]()
