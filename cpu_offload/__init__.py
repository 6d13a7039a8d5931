"""CPU LoRA workers (Numba, shared memory) for CPU-assisted prefill.

Never imports jax: its worker processes are started with `spawn`.
"""
