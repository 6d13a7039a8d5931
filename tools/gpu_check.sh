#!/usr/bin/env bash
# The whole GPU check (issue #19): compiled kernel tests, kernel bandwidth, Llama-2-7B step
# costs, prefill and cold starts, every table and log in one folder. In two runs, each
# inside a device machine's 10-minute limit for one command:
#
#   tools/gpu_check.sh OUT_DIR part1     # probe tests engine kernels (about 4 min)
#   tools/gpu_check.sh OUT_DIR part2     # probe decode coldstart (about 8.5 min)
#   tools/gpu_check.sh OUT_DIR part3     # probe prefill (up to 9 min: it compiles)
#   tools/gpu_check.sh OUT_DIR STAGE...  # any stages, in the order given
#   REHEARSE=1 tools/gpu_check.sh OUT_DIR STAGE...  # on a CPU: cpu-tiny, quick, interpreted
#
# `attention` is in no part (about 4 min): base and BGMV decode with the Triton
# decode-attention kernel (`--decode-attention pallas`), beside part2's XLA attention.
# `profile` is in no part (about 4 min): where a LoRA decode step's time goes
# (`bench.step_profile`: device busy and idle time, kernels and top ops per step, with the
# layer loop scanned and unrolled; the compiled steps' HLO beside it).
#
# (from the repository root, on a GPU machine). Each stage runs under its own time limit
# (seconds, below) and a failure does not stop the next; OUT_DIR gets STAGE.log, the
# benches' .md and .json (cold starts write theirs after every mode), summary.txt (one
# line per stage: exit code, seconds) and gpu-check.tar.gz holding all of it. Measured on
# an H200 (2026-11-27, the layers scanned): probe 16 s, tests 52 s, kernels 55 s, decode
# 230 s, cold starts 156 s (real link) and 95 s (1 GB/s); prefill did not finish in 120 s;
# engine not yet run. A GPU engine now unrolls its layers (EngineConfig.layer_loop), which
# compiles each step for longer: about 50 s against 40 s for the steps a 7B engine's run
# meets, and a full warm-up did not finish in 330 s (2026-11-28). bench.lora_decode now
# compiles on demand (decode's limit is a guess); cold starts warm up in full, and their
# limits have not been tried with the layers unrolled.
#
# Python: $PYTHON, else .venv/bin/python if the project is installed, else python3 with the
# repository on PYTHONPATH (a GPU image with JAX, flax, numba, torch and pytest already in
# it). Wheels it lacks, downloaded beforehand into .whl/ (../shared/tools/device-wheels.sh
# flax==0.12.8), are installed into /tmp/site first. The JAX there may be newer than the
# pinned one: the probe records which ran.
set -uo pipefail
out=${1:?usage: tools/gpu_check.sh OUT_DIR [STAGE ...]}
shift
case "${1:-}" in
  part1) stages=(probe tests engine kernels) ;;
  part2) stages=(probe decode coldstart) ;;
  part3) stages=(probe prefill) ;;
  "") echo "usage: tools/gpu_check.sh OUT_DIR part1|part2|part3|STAGE..." >&2; exit 2 ;;
  *) stages=("$@") ;;
esac
for s in "${stages[@]}"; do
  case $s in
    probe | tests | engine | kernels | prefill | decode | attention | coldstart | profile) ;;
    *) echo "unknown stage $s (probe tests engine kernels prefill decode attention coldstart" \
         "profile)" >&2
       exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# One compilation cache for every stage: engines of the same shapes compile once.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jlora-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
if [ -n "${REHEARSE:-}" ]; then  # the CPU rehearsal: every stage, tiny and quick
  LLAMA=(--model cpu-tiny --dtype float32) BATCH=4 COUNTS=2 QUICK=(--quick) LENGTHS=32,64
  KERNELS=(--quick) TESTS=Interpret REQUESTS=3 SCALE=4
else
  LLAMA=(--model llama2-7b --dtype bfloat16) BATCH=32 COUNTS=32 QUICK=() LENGTHS=128,512
  KERNELS=(--batches 1,16,32,64 --ranks 16,64 --tune) TESTS="not Interpret" REQUESTS=12 SCALE=1
fi
PROBE='import importlib, jax
for name in ("jax", "jaxlib", "flax", "numba", "numpy", "torch", "triton", "transformers"):
    try: print(name, importlib.import_module(name).__version__)
    except Exception as err: print(name, "missing:", err)
print("devices", jax.devices(), "backend", jax.default_backend())
print("memory", jax.devices()[0].memory_stats())'


stage() {  # NAME LIMIT_S COMMAND...: run it, log it, record its exit code and seconds
  local name=$1 limit=$(($2 * SCALE)) start rc
  shift 2
  echo "== $name (limit ${limit}s)" | tee -a "$out/summary.txt"
  echo "\$ $*" >"$out/$name.log"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >>"$out/$name.log" 2>&1
  rc=$?
  echo "   $name: exit $rc after $(($(date +%s) - start))s" | tee -a "$out/summary.txt"
}

for s in "${stages[@]}"; do
  case $s in
    probe)  # the GPU, and the versions that ran (the image's JAX may not be the pinned one)
      stage probe 60 bash -c "nvidia-smi || true; df -h /dev/shm; $PYTHON -c '$PROBE'" ;;
    tests)  # the compiled kernel classes against their references
      XLA_PYTHON_CLIENT_PREALLOCATE=false stage tests 90 "$PYTHON" -m pytest -q \
        -p no:cacheprovider -n 4 --timeout 80 -k "$TESTS" \
        tests/test_bgmv_kernel.py tests/test_mbgmv_kernel.py tests/test_sgmv_kernel.py \
        tests/test_decode_attention_kernel.py ;;
    engine)  # every backend and packed prefill through the engine, on cpu-tiny
      XLA_PYTHON_CLIENT_PREALLOCATE=false stage engine 150 "$PYTHON" -m pytest -q \
        -p no:cacheprovider -n 4 --timeout 140 tests/test_lora_backend.py \
        tests/test_packed_prefill.py ;;
    kernels)
      stage kernels 180 "$PYTHON" -m bench.kernels "${KERNELS[@]}" \
        --markdown "$out/kernels.md" --json "$out/kernels.json" ;;
    decode)  # base-only against 32 distinct rank-16 adapters on the attention, each backend
      # (its slots on those four targets)
      stage decode 330 "$PYTHON" -m bench.lora_decode "${LLAMA[@]}" "${QUICK[@]}" \
        --batch "$BATCH" --counts "$COUNTS" --targets q_proj,k_proj,v_proj,o_proj --backends reference,bgmv,mbgmv \
        --json "$out/decode.json" ;;
    attention)  # the same base and BGMV steps with the Triton decode-attention kernel
      stage attention 240 "$PYTHON" -m bench.lora_decode "${LLAMA[@]}" "${QUICK[@]}" \
        --batch "$BATCH" --counts "$COUNTS" --targets q_proj,k_proj,v_proj,o_proj --backends bgmv --decode-attention pallas \
        --json "$out/decode-attention.json" ;;
    prefill)  # did not finish in 120 s (2026-11-27) nor 190 s (2026-11-28, warming up in
      # full with the layers unrolled); bench.prefill now compiles only the shapes it meets
      stage prefill 520 "$PYTHON" -m bench.prefill "${LLAMA[@]}" --lengths "$LENGTHS" \
        --json "$out/prefill.json" ;;
    coldstart)  # rank-64 slots, the real link, then an emulated slow one (cached compiles)
      for link in 0:240 1:120; do
        stage "coldstart-${link%:*}" "${link#*:}" "$PYTHON" -m bench.cold_start "${LLAMA[@]}" \
          --requests "$REQUESTS" --rate 3 --link-gbps "${link%:*}" --sections trace \
          --markdown "$out/coldstart-${link%:*}.md" --json "$out/coldstart-${link%:*}.json"
      done ;;
    profile)  # where a decode step's time goes (bench.step_profile): no-lora, and BGMV with no
      # adapter in the batch and with 32, the layers unrolled (the GPU's default; 2026-11-28:
      # 280 s for three ways of two systems), with the compiled decode steps' HLO kept
      # (decode-hlo.tar.gz): the trace names a fusion but not what it reads. The LoRA
      # engines' slots cover the adapters' four targets (to 2026-11-28: all seven, so
      # each layer ran seven targets' kernels, three of them for no adapter)
      hlo=/tmp/jlora-decode-hlo
      rm -rf "$hlo"
      XLA_FLAGS="--xla_dump_to=$hlo --xla_dump_hlo_module_re=jit__decode --xla_dump_hlo_as_text" \
        stage profile 300 "$PYTHON" -m bench.step_profile "${LLAMA[@]}" --batch "$BATCH" \
        --adapters "0,$COUNTS" \
        --backend bgmv --targets q_proj,k_proj,v_proj,o_proj --variants unrolled \
        --markdown "$out/profile.md" --json "$out/profile.json"
      (cd "$hlo" && tar -czf "$out/decode-hlo.tar.gz" ./*after_optimizations.txt) ;;
  esac
done
tar -czf /tmp/gpu-check.tar.gz -C "$out" --exclude gpu-check.tar.gz . && mv /tmp/gpu-check.tar.gz "$out/"
cat "$out/summary.txt"
