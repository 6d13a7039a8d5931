"""CaraServe's CPU LoRA workers: the pool that computes x·A·B on CPU cores while an
adapter is still being copied to the device (CaraServe §4, Toppings §4).

`CpuLoraPool` (pool.py) owns the worker processes (one per core, started with `spawn`;
or none, computing on threads of the calling process where the device is the CPU),
which read A and B in place from the host store's shared-memory arena; `protocol` is
the shared-memory control block they poll. The compiled code they run is the
`kernels` package's (Numba and OpenBLAS on raw memory), which jlora's host kernels
(`jlora.model.host`) share.

Never imports jax: it receives plain numbers (segment names, byte offsets, shapes).
"""

from cpu_offload.pool import CpuLoraPool, Ticket
from cpu_offload.protocol import MAX_JOBS, LoraJob
from cpu_offload.workers import Profile

__all__ = ["MAX_JOBS", "CpuLoraPool", "LoraJob", "Profile", "Ticket"]
