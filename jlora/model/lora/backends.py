"""The batched-LoRA backends by name: what `EngineConfig.lora_backend` selects."""

from __future__ import annotations

from jlora.model.lora.base import KVPagesBackend, LoraBackend
from jlora.model.lora.pallas import BgmvBackend, MbgmvBackend, PooledMbgmvBackend
from jlora.model.lora.reference import PooledReferenceBackend, ReferenceBackend

__all__ = ["BACKENDS", "POOLED", "make_backend"]

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


def make_backend(name: str, page_width: int | None = None, *, host: bool = False) -> LoraBackend:
    """The backend `name`; page_width: where the adapters may live in the KV cache (one
    device), the values a page holds per layer: a backend of POOLED then keeps them
    there (BGMV keeps its stacked slots: pallas.py says why). `host`: the cache lies in
    host memory (one CPU device), where the pooled reference's products run as host
    kernels (`jlora.model.host.backend`, imported only then: it loads Numba)."""
    if name not in BACKENDS:
        raise ValueError(f"lora_backend={name!r} must be one of {list(BACKENDS)}")
    if page_width and name in POOLED:
        if host and name == "reference":
            from jlora.model.host.backend import HostPooledBackend

            return HostPooledBackend(page_width)
        return POOLED[name](page_width)
    return BACKENDS[name]()
