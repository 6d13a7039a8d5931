"""What the benchmarks (`bench.<name>`) share; none of it is an entry point.

- `workloads`: serving workloads (Poisson, the Azure trace, multi-turn sessions), their
  adapters, synthesised prompts and JSONL file.
- `harness`: the open-loop client: a workload replayed against an OpenAI-compatible
  or jlora.v1 server, a record per request, the summary.
- `processes`: a server under test or benchmark as a child process (`ServerProcess`),
  `wait_for`, and the Prometheus counters a server exposes (`scrape`).
- `report`: the machine's facts and results under names that never overwrite a run.
- `timing`: prompts and timed decode runs of jlora's engines, side by side.
- `engines`: the LoRA decode engines `lora_decode` times and `step_profile` traces.
- `plots`: CDF plots (PNG).
- `cluster`: the simulated cluster `simulator` runs: instances, batching, routing.
"""
