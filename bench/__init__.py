"""Benchmarks: jlora against the PyTorch baselines and against itself.

Every module here is an entry point, `python -m bench.<name>` (most with a `make`
target; docs/benchmarks.md lists them):

- serving, with real processes: `suite` (`make bench`: one Azure-trace workload
  through every system), `soak` (minutes of mixed load against `jlora up`, a worker
  killed), `dlora_migration` (request migration off and on behind the router);
- workloads on one engine: `cache` (FastLibra's cache policies), `dlora` (merged,
  unmerged and dynamic batching), `kv_allocation`, `chunked_prefill`, `replay`
  (against transformers + PEFT);
- starting: `cold_start` (time to first token per `--lora-mode`), `startup` (`jlora
  generate`, cold and with a warm compile cache);
- the engine's steps: `throughput` (against transformers), `lora_decode`, `prefill`,
  `step_profile` (a profiler's view of a decode step), `sharding`, `kernels`,
  `cpu_offload`;
- the cluster simulator: `simulator`;
- the tools on their own: `workloads` (writes a workload file), `serve` (replays one
  against any running server).

Folders: `lib/` the modules the entry points share (workloads, the open-loop harness,
server processes, timing, the LoRA decode engines, reports, plots, the simulated
cluster); `baselines/` the PyTorch baselines (transformers + PEFT behind the same
OpenAI API); `data/` the Azure LLM inference trace 2023; `results/` every committed
figure, with its machine and date.
"""
