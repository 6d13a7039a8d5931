"""Serving settings of one engine: dtype, decode slots, KV cache paging, buckets."""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

from configs.model import ConfigError, ModelConfig
from configs.sharding import ShardingConfig

DTYPES = ("float32", "bfloat16")
# The Llama projections a LoRA adapter may target, in the canonical order of every
# adapter layout (host store, device slots).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_MODES = ("ondemand", "cached", "cpu-assist", "auto")  # the first is the default
LORA_BACKENDS = ("reference", "bgmv", "mbgmv")
LORA_POOLS = ("kv", "slots")
CPU_LORA = ("auto", "threads", "processes")  # the first is the default
MERGE_MODES = ("never", "auto", "always")  # the first is the default
CACHE_POLICIES = ("fastlibra", "lru", "none")  # the first is the default
KV_ALLOCATIONS = ("lazy", "upfront")  # the first is the default
LAYER_LOOPS = ("auto", "scan", "unrolled")  # the first is the default
DECODE_ATTENTIONS = ("xla", "pallas")  # the first is the default
# A prefill is split across two compiled calls on smaller buckets where that saves at
# least this many padding tokens (the orchestrator's chunks, packed calls): about what a
# call of its own costs (on a CPU a call's fixed cost is some 25-30 tokens' worth).
SPLIT_TOKENS = 32


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2·low, 4·low, ... up to and including high (high need not be a power of two)."""
    buckets, size = [], low
    while size < high:
        buckets.append(size)
        size *= 2
    return (*buckets, high)


def bucket(buckets: Sequence[int], length: int) -> int:
    """The smallest of the sorted `buckets` that holds `length`."""
    return buckets[bisect.bisect_left(buckets, length)]


def _quarters(high: int, low: int) -> tuple[int, ...]:
    """high, high // 4, high // 16, ... while at least low, ascending."""
    sizes = [high]
    while sizes[-1] // 4 >= low:
        sizes.append(sizes[-1] // 4)
    return tuple(reversed(sizes))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How one engine serves.

    max_seq_len: the longest sequence (prompt + generated tokens) a slot can hold.
    kv_cache_tokens: total KV capacity in tokens (0: every slot at max_seq_len).
      Smaller values oversubscribe: requests reserve only the blocks they can use.
    prefill_buckets / decode_buckets: compiled lengths (0-tuple: powers of two from
      min_bucket up to max_seq_len). A prompt is padded to the next prefill bucket; a
      decode step attends over the next decode bucket above the longest running
      sequence.
    decode_row_buckets: compiled decode batch sizes (vLLM's CUDA-graph capture sizes):
      a decode step runs its live rows gathered into the smallest of these that holds
      them, so a batch that has drained to a few rows stops paying for max_slots (a
      SmolLM2 step over 512 keys on a CPU takes about 0.4x its 32-row time at 8 rows,
      under 0.2x at 1).
      0-tuple: max_slots, then a quarter of it while that is at least 8 (32 slots: 8
      and 32); each size costs a compile per decode bucket at warm-up. Must end at
      max_slots.
    prefill_token_budget: prompt tokens prefilled per iteration, beside its decode
      step (vLLM's chunked prefill): a prompt longer than what is left of it is
      prefilled in chunks of whole blocks over the next iterations, so a long prompt
      never stalls the running streams for longer than one budget's prefill. A
      CPU-assisted prefill runs whole. At least block_size.
    packed_prefill_tokens / packed_prefill_prompts / packed_prefill_prompt_tokens: a
      packed prefill (the device engine's `prefill_many`) runs up to this many prompt
      tokens of up to this many prompts (at most max_slots), each of at most this many
      tokens (a longer one runs alone), in one compiled call padded to the prefill
      bucket holding them: one variant per prefill bucket up to packed_prefill_tokens,
      compiled at warm-up. The longest prompt bounds the keys a token's attention reads
      (the scores cost about 1.5 · packed_prefill_prompt_tokens per token, not the
      call's length; on one CPU device in fp32 a host kernel reads each prompt's own
      keys alone). 0 (any), or fewer than two prompts: no packing, nothing more
      compiled.
    max_loras: device adapter slots (0: serve the base model only, no LoRA code in the
      compiled steps). max_lora_rank: the slots' rank; lora_targets: the projections
      they hold. Adapters of higher rank or other targets are refused at registration.
      Where the adapters live in the KV cache's pages (lora_pool "kv" on one device)
      under cache_policy "fastlibra" or "none", the pool, not max_loras, sets how many
      stay resident (as many as their ranks' pages fit); max_loras then sizes the
      default pool (room for that many adapters at max_lora_rank).
    lora_mode: "ondemand" loads an adapter into a slot when a request needs it (the
      running batch keeps decoding meanwhile) and prefills once it has landed;
      "cached" loads and pins every adapter when it is registered; "cpu-assist"
      prefills a request for a cold adapter at once, its LoRA computed by CPU workers
      for the layers whose group has not landed yet (CaraServe/Toppings §4); "auto"
      picks between cpu-assist and waiting per request by a cost model.
    cpu_workers: CPU LoRA workers for cpu-assist and auto, besides the engine's own
      thread: worker processes, or threads (0: one per core this process may use, less
      one for the engine's thread).
    cpu_lora: where those products run: "processes" (worker processes over shared
      memory; they overlap an accelerator's base projections), "threads" (threads of
      the engine's process, the host callback's among them: no copies or hand-offs),
      "auto" (threads where the device is the CPU, else processes).
    lora_layer_groups: an adapter is transferred (and a CPU-assisted prefill is run)
      in this many layer groups (Toppings §4.1, pipelined loading).
    lora_backend: the batched-LoRA implementation:
      "reference" (plain jnp), "bgmv" (Punica's stacked slots and kernel) or "mbgmv"
      (S-LoRA's page pool and kernel); both Pallas backends prefill with SGMV.
    lora_pool: where the reference and MBGMV backends keep the adapters on one device:
      "kv" in the KV cache's own pages (FastLibra's unified pool: memory goes to KV or
      to adapters as the load asks, each adapter taking the pages of its own rank), or
      "slots" in their own slots of max_lora_rank beside the cache (its pages in the
      pool then only stand for their bytes). BGMV, and any backend on a
      tensor-parallel mesh, keep their own slots whatever this says.
    merge: dLoRA's merged inference (§4.1-4.2), one adapter folded into the base weights
      (W + B·A) so that its rows run with no LoRA work: "never" always serves unmerged
      (adapters of any mix batched together, each row's delta added); "auto" switches
      between merged and unmerged dynamically (dLoRA's Algorithms 1-3); "always" is
      merged-only, serving one adapter at a time, merged. Needs max_loras > 0 and
      lora_mode "ondemand" or "cached". While
      merged the device holds the pristine and the merged copies of that adapter's
      target weights.
    cache_policy: how device memory is shared between KV blocks and adapters, and what
      is kept after a request (jlora/engine/memory): "fastlibra" (FastLibra: one pool of pages
      for KV blocks and adapter rank rows, a prefix cache keyed by adapter content with
      usage dependencies, a cost-model swapper to and from a host pool), "lru" (vLLM's:
      a static share of the pool for max_loras adapters at max_lora_rank, the prefix
      cache evicted least-recently-used to the host pool), "none" (S-LoRA's: one pool,
      no history KV: a request's blocks are freed when it finishes).
    kv_allocation: how a request's KV blocks are taken: "lazy" (vLLM's: its prompt's at
      admission, then one block at a time as it decodes; when the pool runs out, the
      newest request is preempted and recomputed later, its cached blocks reused) or
      "upfront" (the blocks of its whole sequence, prompt + max_tokens, at admission: no
      preemption, fewer requests at once).
    pool_bytes: the device pool's size in bytes (KV blocks and, under "fastlibra" and
      "none", adapter rank rows); 0: pool_fraction, else kv_cache_tokens' blocks.
    pool_fraction: the device pool as this fraction of the device memory free after the
      weights are placed (devices that report their memory only); 0: not used.
    host_pool_mib: the host pool holding swapped-out KV blocks (0: nothing is swapped
      out; evicted KV is dropped).
    host_store_mib: capacity of the shared-memory arena holding registered adapters.
    emulated_link_gbps: if positive, adapter transfers to the device are throttled to
      this many gigabytes per second (a test and benchmark knob: a CPU-only machine
      has no real host-to-device link, so cold starts would otherwise cost nothing).
    layer_loop: how a compiled step walks the layers of the stacked weights: "scan" (a
      `lax.scan`: one layer's code, compiled once), "unrolled" (a Python loop: each
      layer's code of its own, its weights static slices of the stack; longer compiles)
      or "auto" (unrolled on a GPU, a scan elsewhere). Inside a scan XLA:GPU copies each
      layer's weights out of the stack before its matmuls read them: a Llama-2-7B
      decode step of 32 rows takes nearly twice as long scanned as unrolled. The price
      is compile time: each step holds every layer's code, and a 7B engine's full
      warm-up compiles for minutes on a first start (the persistent compilation cache
      serves later ones).
    decode_attention: how a decode step attends over each row's cached blocks: "xla"
      (gathers the blocks, then two products and a softmax: XLA's kernels; on one CPU
      device in fp32, the host kernel) or "pallas" (pallas_kernels/decode_attention: one
      Triton kernel walking each row's blocks, a KV head's keys read once for its group
      of query heads; interpreted off a GPU, which is slow: for tests). "pallas" needs
      the query heads per KV head, head_dim and block_size to be powers of two.
      On a CPU the scan reads each layer's weights in place through per-layer views
      (jlora/model/host/layer_views.py).
    sharding: the device mesh and placement rules (configs/sharding.py); None is one
      device.
    """

    dtype: str = "float32"
    max_slots: int = 8
    max_seq_len: int = 2048
    block_size: int = 16
    kv_cache_tokens: int = 0
    prefill_buckets: tuple[int, ...] = ()
    decode_buckets: tuple[int, ...] = ()
    decode_row_buckets: tuple[int, ...] = ()
    min_bucket: int = 32
    prefill_token_budget: int = 512
    packed_prefill_tokens: int = 512
    packed_prefill_prompts: int = 16
    packed_prefill_prompt_tokens: int = 64
    max_loras: int = 0
    max_lora_rank: int = 64
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_mode: str = "ondemand"
    lora_backend: str = "reference"
    lora_pool: str = "kv"
    merge: str = "never"
    cache_policy: str = "fastlibra"
    kv_allocation: str = "lazy"
    pool_bytes: int = 0
    pool_fraction: float = 0.0
    host_pool_mib: int = 1024
    host_store_mib: int = 1024
    emulated_link_gbps: float = 0.0
    cpu_workers: int = 0
    cpu_lora: str = CPU_LORA[0]
    lora_layer_groups: int = 4
    layer_loop: str = LAYER_LOOPS[0]
    decode_attention: str = DECODE_ATTENTIONS[0]
    sharding: ShardingConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"EngineConfig.dtype={self.dtype!r} must be one of {DTYPES}")
        for field in (
            "max_slots",
            "max_seq_len",
            "block_size",
            "min_bucket",
            "prefill_token_budget",
            "max_lora_rank",
            "host_store_mib",
            "lora_layer_groups",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"EngineConfig.{field}={value!r} must be a positive integer")
        if self.max_seq_len % self.block_size:
            raise ConfigError(
                f"EngineConfig.max_seq_len={self.max_seq_len} must be a multiple "
                f"of block_size={self.block_size}"
            )
        if self.prefill_token_budget < self.block_size:
            raise ConfigError(
                f"EngineConfig.prefill_token_budget={self.prefill_token_budget} must be at "
                f"least block_size={self.block_size} (a chunk is whole blocks)"
            )
        if not isinstance(self.cpu_workers, int) or self.cpu_workers < 0:
            raise ConfigError(
                f"EngineConfig.cpu_workers={self.cpu_workers!r} must be >= 0 (0: one per core)"
            )
        for field in (
            "packed_prefill_tokens",
            "packed_prefill_prompts",
            "packed_prefill_prompt_tokens",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"EngineConfig.{field}={value!r} must be >= 0 (0: no packing)")
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ConfigError(f"EngineConfig.max_loras={self.max_loras!r} must be >= 0")
        targets = tuple(self.lora_targets)
        if not targets or any(t not in LORA_TARGETS for t in targets):
            raise ConfigError(
                f"EngineConfig.lora_targets={targets!r} must be a non-empty subset of "
                f"{LORA_TARGETS}"
            )
        object.__setattr__(self, "lora_targets", tuple(t for t in LORA_TARGETS if t in targets))
        if not (isinstance(self.emulated_link_gbps, int | float) and self.emulated_link_gbps >= 0):
            raise ConfigError(
                f"EngineConfig.emulated_link_gbps={self.emulated_link_gbps!r} must be >= 0 "
                "(0: no throttle)"
            )
        for field, choices in (
            ("cpu_lora", CPU_LORA),
            ("lora_mode", LORA_MODES),
            ("lora_backend", LORA_BACKENDS),
            ("lora_pool", LORA_POOLS),
            ("layer_loop", LAYER_LOOPS),
            ("decode_attention", DECODE_ATTENTIONS),
            ("merge", MERGE_MODES),
            ("cache_policy", CACHE_POLICIES),
            ("kv_allocation", KV_ALLOCATIONS),
        ):
            value = getattr(self, field)
            if value not in choices:
                raise ConfigError(f"EngineConfig.{field}={value!r} must be one of {choices}")
        if self.merge != "never" and not self.max_loras:
            raise ConfigError(
                f"EngineConfig.merge={self.merge!r} needs adapters: max_loras="
                f"{self.max_loras} must be positive (or merge='never')"
            )
        if self.merge != "never" and self.lora_mode not in ("ondemand", "cached"):
            raise ConfigError(
                f"EngineConfig.merge={self.merge!r} works with lora_mode 'ondemand' or "
                f"'cached', not {self.lora_mode!r}: a merged batch runs only adapters already "
                "on the device, so CPU-assisted cold starts would never be used"
            )
        if not isinstance(self.pool_bytes, int) or self.pool_bytes < 0:
            raise ConfigError(f"EngineConfig.pool_bytes={self.pool_bytes!r} must be >= 0")
        if not (_number(self.pool_fraction) and 0.0 <= self.pool_fraction < 1.0):
            raise ConfigError(
                f"EngineConfig.pool_fraction={self.pool_fraction!r} must be in [0, 1)"
            )
        if self.pool_bytes and self.pool_fraction:
            raise ConfigError(
                "EngineConfig.pool_bytes and EngineConfig.pool_fraction are exclusive: "
                "give the pool's size one way"
            )
        if not isinstance(self.host_pool_mib, int) or self.host_pool_mib < 0:
            raise ConfigError(f"EngineConfig.host_pool_mib={self.host_pool_mib!r} must be >= 0")
        if self.kv_cache_tokens < 0:
            raise ConfigError(f"EngineConfig.kv_cache_tokens={self.kv_cache_tokens} is negative")
        default = _powers_of_two(min(self.min_bucket, self.max_seq_len), self.max_seq_len)
        for field in ("prefill_buckets", "decode_buckets"):
            buckets = tuple(sorted(getattr(self, field))) or default
            if buckets[-1] != self.max_seq_len or buckets[0] <= 0:
                raise ConfigError(
                    f"EngineConfig.{field}={buckets} must be positive and end at "
                    f"max_seq_len={self.max_seq_len}"
                )
            object.__setattr__(self, field, buckets)
        rows = tuple(sorted(self.decode_row_buckets)) or _quarters(self.max_slots, 8)
        if rows[-1] != self.max_slots or rows[0] <= 0:
            raise ConfigError(
                f"EngineConfig.decode_row_buckets={rows} must be positive and end at "
                f"max_slots={self.max_slots}"
            )
        object.__setattr__(self, "decode_row_buckets", rows)
        for size in self.decode_buckets:
            if size % self.block_size:
                raise ConfigError(
                    f"EngineConfig.decode_buckets has {size}, not a multiple of "
                    f"block_size={self.block_size}"
                )

    @property
    def blocks_per_seq(self) -> int:
        return self.max_seq_len // self.block_size

    @property
    def num_blocks(self) -> int:
        tokens = self.kv_cache_tokens or self.max_slots * self.max_seq_len
        return max(math.ceil(tokens / self.block_size), self.blocks_per_seq)

    def check_model(self, model: ModelConfig) -> None:
        """ConfigError unless this engine can serve `model` exactly: a context within the
        model's, and within its sliding window where it has one (attention over a window
        is not implemented, so a served context the window covers is full attention)."""
        if self.max_seq_len > model.max_context:
            raise ConfigError(
                f"EngineConfig.max_seq_len={self.max_seq_len} exceeds the model's context "
                f"length {model.max_context}"
            )
        window = model.sliding_window
        if window is not None and self.max_seq_len > window:
            within = window // self.block_size * self.block_size
            raise ConfigError(
                f"the model's sliding_window={window} is below EngineConfig.max_seq_len="
                f"{self.max_seq_len}: attention over a sliding window is not implemented; "
                f"serve a context within it (--max-seq-len {within})"
            )
