"""Compiled CPU code on raw memory (Numba, OpenBLAS), shared by CaraServe's worker pool
(`cpu_offload.pool`) and jlora's host kernels (`jlora.model.host`):

- `blas`: `lora_rows` (one product, x @ A then @ B by direct sgemm calls, into strided
  output columns) and `lora_task` (every job of one worker's task in one call);
- `team`: helper threads of the calling process that split a product's rows;
- `native`: the raw-memory primitives (pointers, atomics) both of them use;
- `threads`: the lock that lets one parallel Numba kernel launch at a time in a process.

Importing this package compiles nothing; each module compiles (or loads from Numba's
cache) its own kernels when imported. Never imports jax.
"""
