"""CPU-assisted prefill (CaraServe §4, Toppings §4): a request whose adapter is still on
its way to the device is prefilled at once, its LoRA computed on CPU cores for the layer
groups that have not landed.

prefill.py    the prefill as layer-group segments, each layer routed to the device or the CPU
callbacks.py  `CpuAssist`: the host callbacks the jitted prefill makes (submit, collect, apply)
apply.py      `apply` as an XLA FFI handler where the device is the CPU (no Python in the step)
"""
