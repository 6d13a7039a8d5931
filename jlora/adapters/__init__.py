"""LoRA adapters as files and in host memory: PEFT directories read, checked and written
(`peft`), and the shared-memory host store every registered adapter lives in (`store`),
which the device engine copies from and CaraServe's CPU workers read in place.
No jax: this is the host side of an adapter."""
