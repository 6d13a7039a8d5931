"""LoRA kernels in Pallas (BGMV, MBGMV, SGMV), each beside its plain-jnp reference.

Imports only jax and numpy: it knows nothing of models or serving.
"""
