"""The device engine: JAX on the accelerator (or the CPU device), behind the interface of
`jlora.engine.device_api.DeviceEngine`.

llama_engine.py  `LlamaEngine`: params, paged KV, adapter weights and decode rows, and
                 `build_engine` (an orchestrator over one)
steps.py         the compiled steps (prefill, packed prefill, segments, decode) per shape
packing.py       several short prompts to one compiled prefill call
sampling.py      the jitted sampler (per-row temperature, top-k, top-p, seed)
lora_slots.py    adapters' weights on the device, copied layer group by layer group
cpu_assist/      CaraServe's CPU-assisted prefill: segments, host callbacks, the FFI apply
multiprocess.py  one engine over several processes (`jax.distributed`)
"""
