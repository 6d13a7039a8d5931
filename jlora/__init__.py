"""jlora: serve many LoRA adapters on one shared base LLM, in JAX.

Importing this package (or `jlora.api`) never imports jax; the heavy modules live
in `jlora.model` and `jlora.engine` and are imported where they are used.
"""

__version__ = "0.1.0"
