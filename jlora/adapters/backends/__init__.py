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
from jlora.adapters.backends.reference import ReferenceBackend

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


def make_backend(name: str) -> LoraBackend:
    if name not in BACKENDS:
        raise ValueError(f"lora_backend={name!r} must be one of {list(BACKENDS)}")
    return BACKENDS[name]()
