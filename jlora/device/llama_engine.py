"""The JAX device engine: the Llama model's jitted steps over paged KV and adapter slots.

State, all of it explicit (jlora/engine/device_api.py tells the calls):

- `params`, the KV `cache` (paged: `num_blocks` blocks of `block_size` tokens per
  layer) and the adapter slots' `lora.weights`, split over `mesh` as the sharding
  config says (`tp`, jlora/model/sharding.py: tensor parallel, one device by default);
- the decode rows (rows.py), host arrays that enter the compiled decode step;
- the adapters' bytes: every staged adapter in the host store's shared-memory arena
  (`jlora.adapters.store`), copied to the device by `lora` (lora_slots.py) layer group
  by layer group, rank-exact; the slot's padding is written on the device.

On one device the reference and MBGMV backends keep the adapters in the KV cache's own
pages (FastLibra's unified pool, `KVPagesBackend`; lora_pool "slots" keeps slots of
their own, and BGMV always does): an adapter is written into the pages the
orchestrator's memory manager gives it (`load_adapter`'s `pages`; a caller that names
none gets `slot_pages`, at the top of the pool), so the number of adapters resident
follows from their ranks. The pool's size is `kv_pool.size_pool`'s, carried in `config`.

A prefill pads its prompt to the next prefill bucket and runs in one compiled call that
also samples the first token; a prefill after a cached prefix pads only the new tokens,
in a variant of its own; `prefill_many` packs plain jobs several to a call
(packing.py). A decode step gathers the live rows into the smallest row bucket holding
them and attends over the smallest decode bucket holding the longest row. Every shape
compiles at warm-up (warmup.py), never while serving a known one. In `cpu-assist` and
`auto` modes a prefill whose adapter is still in flight runs layer group by layer group
instead (cpu_assist/): the landed groups are installed before each segment, and the
layers of the groups still in flight compute their LoRA on the CPU. The prefix cache's
swaps copy whole blocks out of the cache and back (`kv_pool.KVBlocks`).

Merged inference (dLoRA §4.1): `merge(name)` folds a staged adapter into a copy of its
target kernels (`jlora.model.merge`, one compiled call) and serves `params` = those
merged kernels beside the untouched rest; `base_params` keeps the pristine arrays,
which `unmerge()` puts back. Warm-up and staging compile every merge a switch may need.

`base_steps`, the steps compiled without LoRA weights, run every call whose rows have
no adapter (picked on the host as the buckets are: no LoRA kernel, no device-side
branch) and, while merged, every call, once its rows are checked to carry the merged
adapter's slot (`_slot_adapter`: the adapter each slot was last loaded with).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import jax
import jax.numpy as jnp
import numpy as np

from configs import EngineConfig, ModelConfig, bucket
from configs.sharding import DEFAULT_SHARDING, load_sharding
from jlora.adapters.store import HostStore
from jlora.contract.adapters import Adapter
from jlora.contract.errors import RequestError
from jlora.contract.peft import read_adapter_config
from jlora.device.kv_pool import KVBlocks, size_pool
from jlora.device.lora_slots import DeviceSlots, Transfer
from jlora.device.packing import PackedPrefill
from jlora.device.rows import DecodeRows
from jlora.device.sampling import SamplingArrays, prefill_outputs, set_sampling
from jlora.device.steps import CompiledSteps, StepSpecs
from jlora.device.warmup import warm_up
from jlora.engine.cost_model import ColdStart
from jlora.engine.device_api import (
    DecodeRow,
    DeviceEngine,
    HostBlocks,
    LogprobArrays,
    Memory,
    Payload,
    Prefilled,
    PrefillJob,
)
from jlora.engine.orchestrator import Orchestrator
from jlora.model.attention import check_decode_kernel
from jlora.model.host import attention as host_attention
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Llama, Params
from jlora.model.lora.backends import make_backend
from jlora.model.lora.base import KVPagesBackend, LoraWeights, Segments
from jlora.model.lora.reference import PooledReferenceBackend
from jlora.model.lora.targets import rank_row_bytes
from jlora.model.merge import WeightMerger
from jlora.model.sharding import TensorParallel, to_host, unrolled_layer_loop
from jlora.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported where used: the CPU workers' kernels load only when needed
    from jlora.device.cpu_assist.callbacks import CpuAssist
    from jlora.device.cpu_assist.prefill import AssistedPrefill

log = logging.getLogger(__name__)


class LlamaEngine(DeviceEngine):
    def __init__(
        self,
        *,
        model_config: ModelConfig,
        params: Params,
        tokenizer: Tokenizer | None,
        engine_config: EngineConfig,
    ) -> None:
        cfg = engine_config
        cfg.check_model(model_config)
        self.config = cfg
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.tokenizer = tokenizer
        self.tp = TensorParallel.build(
            model_config, cfg.sharding or load_sharding(DEFAULT_SHARDING)
        )
        self.mesh = self.tp.mesh
        self.params = self.tp.place_params(params)  # what the steps run: merged or not
        self.base_params = self.params  # the pristine parameters, never modified
        # On one device the reference and MBGMV backends keep the adapters in the KV
        # cache's pages (FastLibra's unified pool; jlora/model/lora/base.py, KVPagesBackend)
        # unless lora_pool says "slots": a page holds a block's keys and values of every
        # layer.
        page_width = 2 * cfg.block_size * self.tp.kv_heads * model_config.head_dim
        pooled = self.tp.size == 1 and cfg.lora_pool == "kv"
        # Where the cache lies in host memory (one CPU device, fp32), host kernels serve
        # the pooled products and the decode attention (jlora.model.host).
        host = host_attention.usable(self.mesh, jnp.dtype(cfg.dtype))
        backend = (
            make_backend(cfg.lora_backend, page_width if pooled else None, host=host)
            if cfg.max_loras
            else None
        )
        self.model = Llama(
            model_config,
            jnp.dtype(cfg.dtype),
            backend,
            tp=self.tp,
            unroll_layers=unrolled_layer_loop(cfg.layer_loop, self.mesh),
            decode_attention=cfg.decode_attention,
        )
        if cfg.decode_attention == "pallas":  # its shapes checked now, not at the first step
            check_decode_kernel(self.model.config, cfg.block_size)
        self.store: HostStore | None = None
        self.lora: DeviceSlots | None = None
        if backend is not None:
            self.store = HostStore(model_config, cfg.host_store_mib * 2**20)
            self.lora = DeviceSlots(
                model_config,
                backend=backend,
                num_slots=cfg.max_loras,
                max_rank=cfg.max_lora_rank,
                targets=cfg.lora_targets,
                dtype=self.model.dtype,
                tp=self.tp,
                layer_groups_per_load=cfg.lora_layer_groups,
                emulated_link_gbps=cfg.emulated_link_gbps,
                measure_link=cfg.lora_mode == "auto",  # only auto's cost model needs it early
            )
        adapter_pages = None
        if self.lora is not None and self.lora.backend.pooled:
            adapter_pages = self._pool_pages(cfg.max_lora_rank, cfg.lora_targets)
        cfg = self.config = size_pool(
            cfg, self.tp, model_config, self.model.dtype, adapter_pages=adapter_pages
        )
        if adapter_pages is not None and cfg.cache_policy != "lru":
            # FastLibra §4.3: the adapters resident follow from their ranks and the pool,
            # not from a slot count. A pooled slot is a row of page tables, and no adapter
            # takes less than a page, so the pool never holds more adapters than it has
            # pages (max_loras then only sizes the default pool). "lru" keeps vLLM's slots.
            # A decode batch of at most max_loras adapters still takes the product over
            # them where that is the faster form (ReferenceBackend.batch_slots).
            assert self.lora is not None
            self.lora.resize(max(cfg.max_loras, cfg.num_blocks))
            if isinstance(self.lora.backend, PooledReferenceBackend):
                self.lora.backend.batch_slots = cfg.max_loras
        cache_specs = KVCache(k=self.tp.kv_spec, v=self.tp.kv_spec)  # type: ignore[arg-type]
        zeros = jax.jit(
            lambda: KVCache.zeros(
                num_layers=model_config.num_layers,
                num_blocks=cfg.num_blocks,
                block_size=cfg.block_size,
                num_kv_heads=self.tp.kv_heads,
                head_dim=model_config.head_dim,
                dtype=self.model.dtype,
            ),
            out_shardings=self.tp.named(cache_specs),
        )
        self.cache = zeros()  # created in place, each device its own heads
        if self.lora is not None:
            self.lora.attach_pool(self.cache)
        self.kv_blocks = KVBlocks(
            self.tp.named(cache_specs), cfg.num_blocks, cfg.emulated_link_gbps
        )
        self.rows = DecodeRows(
            cfg.max_slots,
            cfg.blocks_per_seq,
            cfg.block_size,
            cfg.num_blocks,
            model_config.vocab_size,
        )
        # prefill_many's calls
        self.packed = PackedPrefill(cfg, None if backend is None else backend.segment_rows)
        specs = StepSpecs(
            mesh=self.mesh,
            params=self.tp.param_specs(self.params),
            cache=cache_specs,
            lora=None if self.lora is None else self.lora.specs,
        )
        history = cfg.blocks_per_seq * cfg.block_size

        def compiled(step_specs: StepSpecs) -> CompiledSteps:
            longest = self.packed.longest or None
            return CompiledSteps(
                self.model, step_specs, history, model_config.vocab_size, longest,
                host_attention=host,
            )  # fmt: skip

        self.steps = compiled(specs)
        # The steps without LoRA weights (rows with no adapter, or merged), the fold of
        # merged inference, and its state.
        lora = self.lora is not None
        self.base_steps = compiled(dataclasses.replace(specs, lora=None)) if lora else None
        self.merger = WeightMerger(self.tp, self.params) if lora else None
        self._merged: str | None = None
        self._slot_adapter: dict[int, str] = {}  # slot -> the adapter last loaded into it
        self.cpu: CpuAssist | None = None
        self.assisted: AssistedPrefill | None = None
        if self.lora is not None and cfg.lora_mode in ("cpu-assist", "auto"):
            from jlora.device.cpu_assist.prefill import AssistedPrefill

            self.assisted = AssistedPrefill.for_engine(self)
            self.cpu = self.model.cpu_lora = self.assisted.cpu
        log.info(
            "engine: %d slots, %d KV blocks of %d tokens (%.1f MiB), max_seq_len %d, mesh %s",
            cfg.max_slots,
            cfg.num_blocks,
            cfg.block_size,
            self.cache.nbytes() / 2**20,
            cfg.max_seq_len,
            dict(self.tp.sharding.mesh),
        )

    @property
    def lora_weights(self) -> LoraWeights | None:
        """The adapters' device weights the steps take (None: no LoRA)."""
        return None if self.lora is None else self.lora.weights

    # -- steps -------------------------------------------------------------------------

    def warmup(
        self,
        prompt_lengths: list[int] | None = None,
        max_length: int | None = None,
        *,
        on_demand: bool = False,
    ) -> None:
        """See warmup.py, which says what compiles and why."""
        warm_up(self, prompt_lengths, max_length, on_demand=on_demand)

    def prefill(self, job: PrefillJob) -> Prefilled:
        cfg = self.config
        if job.cached % cfg.block_size or not 0 <= job.cached < len(job.tokens):
            raise AssertionError(
                f"a prefill job's cached={job.cached} must be a multiple of block_size="
                f"{cfg.block_size} below its {len(job.tokens)} tokens"
            )
        sampling = self.steps.sampling_rows(1)
        set_sampling(sampling, 0, job.sampling, job.tokens)
        steps, weights = self._steps_for(np.array([job.adapter_slot]), "a prefill job")
        if weights is None:  # no LoRA work, no CPU assistance: base rows, or merged
            return self._run_prefill(steps, None, job, sampling)
        if job.assist is not None:
            assert self.assisted is not None and self.cpu is not None, "lora_mode: no CPU"
            # A cached prefix is computed again (device_api.py), its blocks left unwritten.
            table = job.block_table.copy()
            table[: job.cached // cfg.block_size] = cfg.num_blocks
            tokens = self._padded(job.tokens)
            whole = dataclasses.replace(job, cached=0)  # every position is computed: score all
            targets = None if job.score_next is None else self._padded(whole.targets(), fill=-1)
            head, self.cache, routes = self.assisted.run(
                self.params,
                self.cache,
                tokens,
                len(job.tokens),
                table,
                job.adapter_slot,
                job.assist,
                sampling,
                targets,
            )
            if (failure := self.cpu.failure) is not None:  # this request's alone
                raise RequestError(
                    f"the CPU-assisted prefill for adapter {job.assist!r} failed: {failure}",
                    reason="CPU_ASSIST_FAILED",
                ) from failure
            prefilled = prefill_outputs(job, head, skip=job.cached)
            return dataclasses.replace(prefilled, routes=routes)
        start = time.perf_counter()
        prefilled = self._run_prefill(steps, weights, job, sampling)
        if self.assisted is not None and not job.cached:  # keep the cost model current
            size = bucket(cfg.prefill_buckets, len(job.tokens))
            self.assisted.observe_prefill(size, time.perf_counter() - start)
        return prefilled

    @property
    def packed_prefill_tokens(self) -> int:
        return self.packed.tokens

    @property
    def packed_prefill_prompts(self) -> int:
        return self.packed.prompts if self.packed.sizes else 0

    @property
    def packed_prefill_prompt_tokens(self) -> int:
        return self.packed.longest

    def prefill_many(self, jobs: Sequence[PrefillJob]) -> list[Prefilled]:
        """The plain jobs (nothing cached; no `assist`, unless merged, where it is ignored;
        at most packed_prefill_prompt_tokens tokens) in packed calls of two or more
        (packing.py); then the others, and a plain job left alone in its call, one by
        one through `prefill`, in order (a cached prefix may be blocks a packed call
        wrote)."""
        results: list[Prefilled | None] = [None] * len(jobs)
        plain = {
            index: len(job.tokens)
            for index, job in enumerate(jobs)
            if job.cached == 0
            and job.score_next is None
            and (job.assist is None or self._merged is not None)
        }
        for call in self.packed.calls(plain):
            slots = np.array([jobs[index].adapter_slot for index in call])
            steps, weights = self._steps_for(slots, "a prefill job")
            packed, self.cache = self.packed.run(
                steps, self.params, self.cache, weights, [jobs[index] for index in call]
            )
            for index, prefilled in zip(call, packed, strict=True):
                results[index] = prefilled
        rest = [index for index, result in enumerate(results) if result is None]
        alone = super().prefill_many([jobs[index] for index in rest])
        for index, result in zip(rest, alone, strict=True):
            results[index] = result
        return cast(list[Prefilled], results)

    def _padded(self, tokens: Sequence[int] | np.ndarray, fill: int = 0) -> np.ndarray:
        """i32[the prefill bucket holding them]: `tokens`, then `fill`."""
        padded = np.full(bucket(self.config.prefill_buckets, len(tokens)), fill, np.int32)
        padded[: len(tokens)] = tokens
        return padded

    def _run_prefill(
        self,
        steps: CompiledSteps,
        weights: LoraWeights | None,
        job: PrefillJob,
        sampling: SamplingArrays,
    ) -> Prefilled:
        """One compiled prefill of the job's tokens after its cached prefix (padded to
        their bucket; the job's adapter on all of them)."""
        new = job.tokens[job.cached :]
        tokens = self._padded(new)
        size = tokens.shape[0]
        segments = None if weights is None else Segments.single(job.adapter_slot, size)
        scored = job.score_next is not None
        steps.compile_prefill(
            self.params,
            self.cache,
            size,
            self.config.blocks_per_seq,
            weights,
            cached=job.cached > 0,
            scored=scored,
        )
        *head, self.cache = steps.prefill(
            self.params,
            self.cache,
            tokens,
            len(new),
            job.block_table,
            sampling,
            weights,
            segments,
            job.cached,
            self._padded(job.targets(), fill=-1) if scored else None,
        )
        return prefill_outputs(job, head)

    def insert(self, slot: int, row: DecodeRow) -> None:
        self.rows.insert(slot, row)

    def generate(self) -> np.ndarray:
        cfg, rows = self.config, self.rows
        blocks = bucket(cfg.decode_buckets, rows.longest()) // cfg.block_size
        batch = rows.batch(bucket(cfg.decode_row_buckets, max(rows.count(), 1)))
        steps, weights = self._steps_for(rows.live_slots(), "a live decode row")
        steps.compile_decode(self.params, self.cache, len(batch), blocks, weights)
        sampled, logprobs, self.cache = steps.decode(
            self.params,
            self.cache,
            *rows.step_inputs(batch, blocks),
            weights,
            None if weights is None else rows.state.lora_idx[batch],
        )
        return rows.advance(batch, to_host(sampled), logprobs)

    def decode_logprobs(self) -> LogprobArrays | None:
        return self.rows.logprobs()

    def constrain(self, slot: int, allowed: np.ndarray | None) -> None:
        self.rows.constrain(slot, allowed)

    def free(self, slot: int) -> None:
        self.rows.free(slot)

    # -- adapters ------------------------------------------------------------------------

    def stage_adapter(self, name: str, path: str, *, expect_sha256: str | None = None) -> Adapter:
        assert self.store is not None and self.lora is not None, "max_loras=0"
        spec = read_adapter_config(path)
        self.lora.check_fits(name, spec.rank, spec.targets)
        stored = self.store.register(name, path, expect_sha256=expect_sha256)
        # Off the scheduler thread: the install of its rank-exact transfers (device_api.py),
        # and with merging on, its merge.
        self.lora.prepare(spec.rank, spec.targets)
        if self.config.merge != "never" and self.merger is not None:
            self.merger.compile(spec.targets, spec.rank)
        return dataclasses.replace(
            stored.adapter, device_bytes=self._adapter_bytes(spec.rank, spec.targets)
        )

    def drop_adapter(self, name: str) -> None:
        assert self.store is not None
        self.store.unregister(name)

    def load_adapter(self, name: str, slot: int, pages: Sequence[int] | None = None) -> Payload:
        assert self.store is not None and self.lora is not None
        self._slot_adapter[slot] = name  # its previous adapter is evicted: no row uses it
        if self.lora.backend.pooled and pages is None:
            pages = self.slot_pages(slot)
        return self.lora.load(name, self.store.tensors(name), slot, pages)

    def install_adapter(self, name: str, slot: int, payload: Payload) -> None:
        assert self.lora is not None
        self.cache = self.lora.install(cast(Transfer, payload), self.cache)  # load_adapter's

    def slot_pages(self, slot: int) -> list[int]:
        """The pool pages an adapter in `slot` takes when the caller names none: the top
        of the pool, slot after slot, each an adapter of max_lora_rank's worth (the room
        `size_pool` adds for max_loras adapters), for callers that take KV blocks from the
        bottom themselves (the orchestrator names its own pool's)."""
        if slot >= self.config.max_loras:
            raise ValueError(
                f"slot {slot}: a caller that names no pool pages has max_loras="
                f"{self.config.max_loras} slots' worth at the pool's top"
            )
        count = self._pool_pages(self.config.max_lora_rank, self.config.lora_targets)
        top = self.config.num_blocks - slot * count
        return list(range(top - count, top))

    @property
    def adapter_slots(self) -> int:
        return 0 if self.lora is None else self.lora.num_slots

    @property
    def can_assist(self) -> bool:
        return self.cpu is not None and self.cpu.usable

    def cold_start(self, name: str, slot: int, prompt_len: int) -> ColdStart | None:
        if self.assisted is None:
            return None
        return self.assisted.cold_start(
            name, slot, prompt_len, bucket(self.config.prefill_buckets, prompt_len)
        )

    # -- KV blocks to and from host memory ----------------------------------------------

    @property
    def can_swap_kv(self) -> bool:
        return True

    def kv_snapshot(self, blocks: Sequence[int]) -> object:
        return self.kv_blocks.snapshot(self.cache, blocks)

    def kv_to_host(self, snapshot: object) -> HostBlocks:
        return self.kv_blocks.to_host(cast(tuple[int, KVCache], snapshot))

    def kv_to_device(self, host: HostBlocks) -> object:
        return self.kv_blocks.to_device(host)

    def kv_restore(self, blocks: Sequence[int], staged: object) -> None:
        self.cache = self.kv_blocks.restore(self.cache, blocks, cast(tuple[int, KVCache], staged))

    # -- merged inference ---------------------------------------------------------------

    @property
    def can_merge(self) -> bool:
        return self.merger is not None

    @property
    def merged(self) -> str | None:
        return self._merged

    def merge(self, name: str) -> None:
        assert self.store is not None and self.merger is not None, "max_loras=0"
        if self._merged is not None:
            raise AssertionError(f"merge({name!r}): {self._merged!r} is merged; unmerge first")
        if name not in self.store:
            raise AssertionError(f"merge({name!r}): no such adapter is staged")
        self.params = self.merger.merge(self.base_params, self.store.tensors(name))
        self._merged = name

    def unmerge(self) -> None:
        if self._merged is None:
            raise AssertionError("unmerge(): no adapter is merged")
        self.params = self.base_params  # the pristine arrays themselves
        self._merged = None

    def _steps_for(self, slots: np.ndarray, what: str) -> tuple[CompiledSteps, LoraWeights | None]:
        """The steps and adapter slots of a call whose rows (or job) are on device adapter
        slots `slots` (-1: none): without LoRA where none has an adapter, or where one is
        merged, once every slot is checked to be the one it was last loaded into."""
        if self._merged is None:
            if self.base_steps is not None and bool((slots < 0).all()):
                return self.base_steps, None
            return self.steps, self.lora_weights
        assert self.base_steps is not None
        for slot in np.unique(slots).tolist():
            if slot < 0 or self._slot_adapter.get(slot) != self._merged:
                owner = "the base model" if slot < 0 else repr(self._slot_adapter.get(slot))
                raise AssertionError(
                    f"{what} of adapter slot {slot} ({owner}) while {self._merged!r} is "
                    "merged: only the merged adapter's rows may run"
                )
        return self.base_steps, None

    # -- the rest --------------------------------------------------------------------------

    def memory(self) -> Memory:
        stats = jax.devices()[0].memory_stats() or {}
        store = self.store
        merged = [
            layer["kernel"].nbytes
            for target, layer in self.params["layers"].items()
            if layer is not self.base_params["layers"][target]
        ]
        return Memory(
            host_store_used=store.arena.bytes_used if store is not None else 0,
            host_store_capacity=store.arena.capacity if store is not None else 0,
            device_in_use=stats.get("bytes_in_use", -1),
            device_limit=stats.get("bytes_limit", -1),
            kv_block_bytes=self._block_bytes,
            lora_slot_bytes=(
                self._adapter_bytes(self.config.max_lora_rank, self.config.lora_targets)
                if self.lora is not None
                else 0
            ),
            merged_weights=sum(merged),
        )

    def _adapter_bytes(self, rank: int, targets: tuple[str, ...]) -> int:
        """The device bytes an adapter of `rank` on `targets` takes: its pool pages where
        the adapters live in the KV cache, else its rank rows."""
        assert self.lora is not None
        if self.lora.backend.pooled:
            return self._pool_pages(rank, targets) * self._block_bytes
        layers, itemsize = self.model_config.num_layers, self.model.dtype.itemsize
        return rank * rank_row_bytes(self.lora.shapes, targets, layers, itemsize)

    @property
    def _block_bytes(self) -> int:
        """One KV block (a pool page): keys and values of every layer."""
        return self.cache.nbytes() // self.config.num_blocks

    def _pool_pages(self, rank: int, targets: Sequence[str]) -> int:
        assert self.lora is not None
        return cast(KVPagesBackend, self.lora.backend).pool_pages(rank, targets)

    def close(self) -> None:
        if self.cpu is not None:
            self.cpu.close()
        if self.store is not None:
            self.store.close()


def build_engine(
    *,
    model_config: ModelConfig,
    params: Params,
    tokenizer: Tokenizer | None,
    engine_config: EngineConfig,
) -> Orchestrator:
    """The serving engine: an orchestrator over a `LlamaEngine`."""
    return Orchestrator(
        LlamaEngine(
            model_config=model_config,
            params=params,
            tokenizer=tokenizer,
            engine_config=engine_config,
        )
    )
