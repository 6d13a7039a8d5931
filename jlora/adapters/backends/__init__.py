"""Batched-LoRA backends: the interface (`base`), plain jnp (`reference`), and the
Pallas kernels (`pallas`: BGMV over stacked slots, MBGMV over a page pool)."""

from __future__ import annotations

from jlora.adapters.backends.base import (
    HostTensors,
    LoraBackend,
    LoraWeights,
    Payload,
    Segments,
    layer_group,
)
from jlora.adapters.backends.pallas import BgmvBackend, MbgmvBackend
from jlora.adapters.backends.reference import PooledReferenceBackend, ReferenceBackend

__all__ = [
    "BACKENDS",
    "HostTensors",
    "LoraBackend",
    "LoraWeights",
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


def make_backend(name: str, page_width: int | None = None) -> LoraBackend:
    """The backend `name`; page_width: where the adapters may live in the KV cache (one
    device), the values a page holds per layer: the reference backend then keeps them
    there (`PooledReferenceBackend`)."""
    if name not in BACKENDS:
        raise ValueError(f"lora_backend={name!r} must be one of {list(BACKENDS)}")
    if page_width and name == "reference":
        return PooledReferenceBackend(page_width)
    return BACKENDS[name]()
