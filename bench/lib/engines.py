"""The LoRA decode engines `bench.lora_decode` times and `bench.step_profile` traces: the
run's `Plan`, one LoRA engine's settings (`System`), `make_engine` (warmed up for the
plan's prompts, its adapters registered) and `spread` (each row's adapter)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from configs import EngineConfig
from configs.engine import LORA_TARGETS
from jlora.adapters.store import store_mib
from jlora.device.llama_engine import build_engine
from jlora.engine.orchestrator import Orchestrator
from jlora.model.loading import LoadedModel
from jlora.model.lora.targets import TARGETS


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    batch: int = 16
    prompt_len: int = 64
    new_tokens: int = 32
    rank: int = 16
    adapter_counts: tuple[int, ...] = (1, 4, 16)
    targets: tuple[str, ...] = TARGETS
    backends: tuple[str, ...] = ("reference",)
    reference_forms: tuple[str, ...] = ("auto",)
    lora_pools: tuple[str, ...] = ("kv",)
    slot_targets: tuple[str, ...] = ("adapters",)
    repeats: int = 3
    decode_attention: str = "xla"  # EngineConfig.decode_attention, every engine's


SLOT_TARGETS = ("adapters", "all")  # the LoRA engines' slots: the adapters' targets, or all


@dataclasses.dataclass(frozen=True)
class System:
    """One LoRA engine of a run: its backend and the settings it runs with."""

    name: str
    backend: str
    form: str = "auto"  # the reference backend's decode form
    pool: str = "kv"  # where the reference and MBGMV backends keep adapters
    slot_targets: str = "adapters"  # SLOT_TARGETS


def spread(names: list[str], count: int, batch: int) -> list[str | None]:
    """Each of `batch` rows' adapter: round-robin over the first `count` of `names`
    (0: none, every row on the base model)."""
    return [names[row % count] if count else None for row in range(batch)]


def lora_targets(plan: Plan, slot_targets: str) -> tuple[str, ...]:
    """The projections a LoRA engine's slots cover (EngineConfig.lora_targets)."""
    return plan.targets if slot_targets == "adapters" else LORA_TARGETS


def make_engine(
    loaded: LoadedModel,
    plan: Plan,
    adapters: dict[str, Path],
    system: System = System("reference", "reference"),
    on_demand: bool = False,
    layer_loop: str = "auto",
) -> Orchestrator:
    """An engine for the plan's decode, warmed up for its prompts (with `on_demand`, each
    shape compiles when first met: a run's untimed first pass compiles what it uses),
    with `system`'s settings where it has adapters (the decode form set before anything
    compiles)."""
    lora: dict[str, Any] = (
        {
            "max_loras": len(adapters),
            "max_lora_rank": plan.rank,
            "lora_mode": "cached",
            "lora_backend": system.backend,
            "lora_pool": system.pool,
            "lora_targets": lora_targets(plan, system.slot_targets),
            "host_store_mib": store_mib(loaded.config, [plan.rank] * len(adapters), plan.targets),
        }
        if adapters
        else {}
    )
    engine = build_engine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        engine_config=EngineConfig(
            dtype=plan.dtype,
            max_slots=plan.batch,
            max_seq_len=256,
            prefill_token_budget=max(plan.batch * plan.prompt_len, 256),  # all in one step
            # No prefix cache: every repetition prefills its prompts again, so the cached
            # blocks of the runs before never fill the pool and delay the next admissions.
            cache_policy="none",
            layer_loop=layer_loop,
            decode_attention=plan.decode_attention,
            **lora,
        ),
    )
    if system.form != "auto":
        engine.device.model.lora.decode_form = system.form  # its instance's alone
    for name, path in adapters.items():
        engine.register_adapter(name, str(path))
    engine.warmup(
        prompt_lengths=[plan.prompt_len],
        max_length=plan.prompt_len + plan.new_tokens + 2,
        on_demand=on_demand,
    )
    return engine
