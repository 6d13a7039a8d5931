"""CPU LoRA workers (Numba, OpenBLAS, shared memory) for CPU-assisted prefill.

While an adapter is still being copied to the device, the LoRA part x·A·B of its
layers runs here, on CPU cores, reading A and B in place from the host store's
shared-memory arena (CaraServe §4, Toppings §4). `CpuLoraPool` owns the worker
processes (one per core, started with `spawn`; or none, computing on threads of the
calling process where the device is the CPU), `protocol` is the shared-memory
control block they poll, `kernels` holds the compiled kernels: `lora_rows` (one
product, x @ A then @ B by direct sgemm calls, into strided output columns) and
`lora_task` (every job of one worker's task in one call), `team` the calling
process's helper threads that split a task's rows where the pool computes on threads
(over the raw-memory primitives of `native`, which jlora's FFI kernels share), and
`threads` the lock that lets one parallel Numba kernel launch at a time in a process
(jlora's FFI kernels on XLA's threads).

Never imports jax: it receives plain numbers (segment names, byte offsets, shapes).
"""

from cpu_offload.kernels import lora_rows, lora_task
from cpu_offload.pool import CpuLoraPool, Profile, Ticket
from cpu_offload.protocol import MAX_JOBS, LoraJob

__all__ = [
    "MAX_JOBS",
    "CpuLoraPool",
    "LoraJob",
    "Profile",
    "Ticket",
    "lora_rows",
    "lora_task",
]
