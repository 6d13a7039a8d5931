"""The host side of the engine (JetStream's orchestrator): requests in plain host state,
driving any device engine through `device_api.DeviceEngine`. Imports neither jax nor
numba (a test checks).

api.py           the request-level types: Request, SamplingParams, TokenEvent, stats
orchestrator.py  `Orchestrator`: carries out each step's plan over the device engine
device_api.py    `DeviceEngine`, the interface of the device layer (`jlora.device`)
adapters.py      which adapters are registered, staged and where (`AdapterManager`)
slots.py         which adapter holds which device slot, loaded in the background
memory/          FastLibra's unified pool of KV blocks and adapter pages, the prefix cache
merging.py       dLoRA's merge/unmerge batching with credits
cost_model.py    CPU-assist or wait, per cold request
detokenizer.py   incremental text and stop strings
mock.py          `MockEngine`: a device engine with no model, for server and router tests
"""
