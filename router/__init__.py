"""The front door: gRPC + OpenAI-compatible HTTP, rank-aware scheduling, registry.

Never imports jax, flax, pallas_kernels or cpu_offload: it runs on a small CPU box.
"""
