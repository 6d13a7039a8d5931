"""The engine, in two layers (JetStream's split):

- `orchestrator.Orchestrator`: requests, in host state: the queue, admission, stop
  rules, adapter bookkeeping (`adapters.py`), stats, failures that stay with their
  request, requests exported and resumed (`api.SequenceState`). The server, the CLI and
  the tests talk to it.
- `device.DeviceEngine`: the jitted steps over explicit device state (params, paged KV,
  adapter slots, the decode rows, the mesh): `llama_engine.LlamaEngine` in JAX, or
  `mock.MockEngine` for server and router tests.

`llama_engine.build_engine(...)` gives the orchestrator over a LlamaEngine.
"""
