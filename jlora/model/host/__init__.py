"""The CPU as the device: host kernels that XLA:CPU calls in place of its own forms where
the model serves on one CPU device in fp32 (vLLM's `punica_cpu.py` beside `punica_gpu.py`).

attention.py    paged decode attention and packed prefill attention (OpenBLAS, Numba)
bgmv.py         the decode LoRA over adapters in the pool's pages, read in place
sgmv.py         the prefill LoRA over them, each segment's rank rows by BLAS
backend.py      `HostPooledBackend`: the pooled reference backend served by those kernels
layer_views.py  every layer's weights as arrays of their own, read in place by decode
ffi.py          the XLA FFI glue the kernels share (Numba `cfunc` handlers)

The compiled code on raw memory is `cpu_offload.kernels`'s, the one part of cpu_offload
the model imports.
"""
