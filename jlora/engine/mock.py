"""A mock device engine: no model, tokens a pure function of (previous token, adapter,
step), for the server and router tests, which run the real orchestrator over it.

`mock_next_token` is the whole "model", so a test knows the exact stream every request
must receive, whatever else shares the batch: `mock_completion` computes it. No jax is
imported; `generate` sleeps `step_latency` seconds in place of the device, and
`lora_latency` more when it runs LoRA work (an adapter's row, unmerged).

Everything else is the device engine's contract (jlora/engine/device_api.py), done for real on the
host: adapters are staged from real PEFT directories (only `adapter_config.json` is
read, and the weights file hashed if there is one), loads run on the orchestrator's
transfer thread (taking `load_latency` seconds; an adapter named in `fail_loads`
fails to load, as a broken transfer would), and a decode row remembers the adapter
installed in its slot. Merging (dLoRA's merged inference) changes no token: `merge`
takes `merge_latency` seconds, and while merged `prefill` and `generate` raise
AssertionError for a job or a live row whose slot is not the one the merged adapter
was last loaded into (another adapter's, or the base model's -1), as LlamaEngine
does, so orchestrator tests catch a scheduler that breaks the invariant.

The KV cache holds no keys, but a record of what every position of every block would
hold: (adapter, token), the adapter being the one installed in the writer's slot (None:
the base model). `prefill` writes the job's new tokens and `generate` each live row's
input token at its position; a prefill with `cached` > 0 first checks that its table's
blocks hold exactly its first `cached` tokens for the same adapter, and raises
AssertionError (a scheduler bug: wrong prefix reuse) if not. The swaps copy these
records (`HostBlocks.data`), each crossing of the link taking `count · kv_block_bytes`
at `emulated_link_gbps`; an adapter takes `rank_row_bytes · rank` on the device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
import zlib
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from configs import ConfigError, EngineConfig
from jlora.contract.adapters import WEIGHTS_FILE, Adapter, check_sha256, sha256_of
from jlora.contract.errors import InvalidRequest
from jlora.contract.peft import read_adapter_config
from jlora.engine.api import MAX_LOGPROBS
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
from jlora.link import wait_for_link

# What one position of a KV block holds in the mock: (adapter, token); None: unwritten.
KVRecord = tuple[str | None, int] | None


def mock_next_token(previous: int, adapter: str | None, step: int, vocab_size: int) -> int:
    """The token after `previous` when `step` tokens have been generated already."""
    salt = 0 if adapter is None else zlib.crc32(adapter.encode())
    return (previous * 7919 + salt + 104729 * (step + 1)) % vocab_size


def mock_completion(
    prompt_ids: list[int], adapter: str | None, num_tokens: int, vocab_size: int
) -> list[int]:
    """The first `num_tokens` tokens a MockEngine generates for this prompt and adapter."""
    tokens: list[int] = []
    previous = prompt_ids[-1]
    for step in range(num_tokens):
        previous = mock_next_token(previous, adapter, step, vocab_size)
        tokens.append(previous)
    return tokens


def mock_logprobs(anchor: int, chosen: Sequence[int], vocab_size: int) -> LogprobArrays:
    """The mock's log-probabilities at len(chosen) positions: at each, the MAX_LOGPROBS (or
    vocabulary) tokens after `anchor` are the most likely, token anchor + j with -(j + 1) /
    8, and `chosen` (-1: none) has its value there, or -8 if not among them. A generated
    token is its position's anchor (the most likely); a prompt position's is the token
    there."""
    width = min(MAX_LOGPROBS, vocab_size)
    top_ids = (anchor + np.arange(width)) % vocab_size
    top = -(np.arange(width, dtype=np.float32) + 1) / 8
    values = {int(t): float(v) for t, v in zip(top_ids, top, strict=True)}
    return LogprobArrays(
        np.array([values.get(c, -8.0) if c >= 0 else 0.0 for c in chosen], np.float32),
        np.tile(top_ids.astype(np.int32), (len(chosen), 1)),
        np.tile(top, (len(chosen), 1)),
    )


class MockTokenizer:
    """Text <-> ids for the mock: a prompt's UTF-8 bytes are its ids; token t reads ' t<t>';
    the EOS ids are its special tokens.

    (Not inverses of each other; the mock only needs both directions to be deterministic.)
    """

    def __init__(self, eos_ids: Collection[int] = ()) -> None:
        self.eos_ids: list[int] = list(eos_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        special = set(self.eos_ids) if skip_special_tokens else set()
        return "".join(f" t{token}" for token in ids if token not in special)

    renders_tools = True

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        shown = f"<tools>{json.dumps(tools)}\n" if tools else ""
        turns = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return shown + turns + "<assistant>"


@dataclasses.dataclass
class _Row:
    token: int  # the last token, written into the cache by the next generate()
    position: int
    block_table: np.ndarray
    step: int
    adapter_slot: int
    logprobs: bool = False
    allowed: np.ndarray | None = None  # a grammar's bitmask of the next token


def allowed_token(token: int, allowed: np.ndarray | None) -> int:
    """`token` if the bitmask `allowed` (None: any) allows it, else the next one it
    allows (cyclically): how the mock follows a grammar."""
    if allowed is None:
        return token
    bits = np.unpackbits(allowed.view(np.uint8), bitorder="little")
    ids = np.flatnonzero(bits)
    later = ids[ids >= token]
    return int(later[0] if len(later) else ids[0])


class MockEngine(DeviceEngine):
    """See the module docstring."""

    def __init__(
        self,
        *,
        max_slots: int = 4,
        max_seq_len: int = 128,
        vocab_size: int = 1000,
        step_latency: float = 0.0,
        lora_latency: float = 0.0,
        max_loras: int = 2,
        max_lora_rank: int = 64,
        block_size: int = 16,
        num_blocks: int | None = None,
        eos_id: int | None = None,
        load_latency: float = 0.0,
        fail_loads: Collection[str] = (),
        merge: str = "never",
        merge_latency: float = 0.0,
        cache_policy: str = "fastlibra",
        kv_allocation: str = "lazy",
        pool_bytes: int = 0,
        host_pool_mib: int = 1024,
        emulated_link_gbps: float = 0.0,
        kv_block_bytes: int = 2**16,
        rank_row_bytes: int = 4096,
        prefill_token_budget: int = 512,
    ) -> None:
        """The device pool holds `pool_bytes // kv_block_bytes` KV blocks when
        pool_bytes is given, else `num_blocks` (default: every slot at max_seq_len)."""
        if vocab_size < 1:
            raise ValueError(f"MockEngine vocab_size={vocab_size} must be positive")
        blocks = num_blocks or max_slots * math.ceil(max_seq_len / block_size)
        if pool_bytes:
            blocks = pool_bytes // kv_block_bytes
            if blocks < max_seq_len // block_size:
                raise ConfigError(
                    f"EngineConfig.pool_bytes={pool_bytes} holds {blocks} KV blocks of "
                    f"{kv_block_bytes} bytes; one sequence of max_seq_len={max_seq_len} "
                    f"needs {max_seq_len // block_size}"
                )
        self.config = EngineConfig(
            max_slots=max_slots,
            max_seq_len=max_seq_len,
            block_size=block_size,
            kv_cache_tokens=blocks * block_size,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            merge=merge,
            cache_policy=cache_policy,
            kv_allocation=kv_allocation,
            host_pool_mib=host_pool_mib,
            emulated_link_gbps=emulated_link_gbps,
            prefill_token_budget=prefill_token_budget,
        )
        self.kv_block_bytes = kv_block_bytes
        self.rank_row_bytes = rank_row_bytes
        # [num_blocks][block_size]: what each position of each block holds.
        self._kv: list[list[KVRecord]] = [
            [None] * block_size for _ in range(self.config.num_blocks)
        ]
        self.vocab_size = vocab_size
        self.tokenizer = MockTokenizer([] if eos_id is None else [eos_id])
        self.step_latency = step_latency
        self.lora_latency = lora_latency
        self.load_latency = load_latency
        self.fail_loads = frozenset(fail_loads)
        self.merge_latency = merge_latency
        self.steps = 0  # generate() calls
        self._logprobs: LogprobArrays | None = None  # the last generate()'s
        self._rows: dict[int, _Row] = {}
        self._staged: dict[str, Adapter] = {}
        self._slots: dict[int, str] = {}  # device adapter slot -> installed adapter
        self._loaded: dict[int, str] = {}  # device adapter slot -> the adapter last loaded
        self._merged: str | None = None

    # -- steps -----------------------------------------------------------------------

    def warmup(
        self,
        prompt_lengths: list[int] | None = None,
        max_length: int | None = None,
        *,
        on_demand: bool = False,
    ) -> None:
        """Nothing to compile."""

    def prefill(self, job: PrefillJob) -> Prefilled:
        adapter = self._adapter_of(job.adapter_slot, "a prefill job")
        self._check_cached(job, adapter)
        for position in range(job.cached, len(job.tokens)):
            self._write(job.block_table, position, (adapter, int(job.tokens[position])))
        token = mock_next_token(job.tokens[-1], adapter, job.sampling.step, self.vocab_size)
        token = allowed_token(token, job.sampling.allowed)
        prompt = None
        if job.score_next is not None:
            positions = range(job.cached, len(job.tokens))
            scores = [
                mock_logprobs(int(job.tokens[position]), [int(target)], self.vocab_size)
                for position, target in zip(positions, job.targets(), strict=True)
            ]
            prompt = LogprobArrays.concatenate(scores)
        first = mock_logprobs(token, [token], self.vocab_size) if job.sampling.logprobs else None
        return Prefilled(token, logprobs=first, prompt=prompt)

    def _check_cached(self, job: PrefillJob, adapter: str | None) -> None:
        """AssertionError unless the job's first `cached` tokens are in its blocks, each
        written by `adapter` (what a prefix-cache hit promises)."""
        size = self.config.block_size
        if job.cached % size or not 0 <= job.cached < len(job.tokens):
            raise AssertionError(
                f"a prefill job's cached={job.cached} must be a multiple of block_size="
                f"{size} below its {len(job.tokens)} tokens"
            )
        for position in range(job.cached):
            block = int(job.block_table[position // size])
            held = self._kv[block][position % size] if block < len(self._kv) else None
            wanted = (adapter, int(job.tokens[position]))
            if held != wanted:
                raise AssertionError(
                    f"wrong prefix reuse: position {position} of a cached={job.cached} "
                    f"prefill is in block {block}, which holds (adapter, token) {held}, "
                    f"not {wanted}"
                )

    def _write(self, block_table: np.ndarray, position: int, record: KVRecord) -> None:
        """Record what a step writes at `position`; dropped where the table has no block
        (the sentinel), as the device drops it."""
        size = self.config.block_size
        if position // size < len(block_table):
            block = int(block_table[position // size])
            if block < len(self._kv):
                self._kv[block][position % size] = record

    def insert(self, slot: int, row: DecodeRow) -> None:
        self._rows[slot] = _Row(
            row.token,
            row.position,
            row.block_table.copy(),
            row.sampling.step,
            row.adapter_slot,
            row.sampling.logprobs,
            row.sampling.allowed,
        )

    def constrain(self, slot: int, allowed: np.ndarray | None) -> None:
        self._rows[slot].allowed = allowed

    def generate(self) -> np.ndarray:
        self.steps += 1
        rows = self._rows.items()  # every row checked before any moves on
        adapters = [self._adapter_of(row.adapter_slot, "a live decode row") for _, row in rows]
        lora = self._merged is None and any(adapter is not None for adapter in adapters)
        latency = self.step_latency + (self.lora_latency if lora else 0.0)
        if latency:
            time.sleep(latency)
        tokens = np.zeros(self.config.max_slots, np.int32)
        for (slot, row), adapter in zip(rows, adapters, strict=True):
            self._write(row.block_table, row.position, (adapter, row.token))
            row.position += 1
            row.token = mock_next_token(row.token, adapter, row.step, self.vocab_size)
            row.token = allowed_token(row.token, row.allowed)
            row.step += 1
            tokens[slot] = row.token
        self._logprobs = None
        if any(row.logprobs for _, row in rows):
            self._logprobs = mock_logprobs(0, [-1] * self.config.max_slots, self.vocab_size)
            for slot, row in rows:
                own = mock_logprobs(row.token, [row.token], self.vocab_size)
                self._logprobs.chosen[slot] = own.chosen[0]
                self._logprobs.top_ids[slot] = own.top_ids[0]
                self._logprobs.top[slot] = own.top[0]
        return tokens

    def decode_logprobs(self) -> LogprobArrays | None:
        return self._logprobs

    def free(self, slot: int) -> None:
        self._rows.pop(slot, None)

    def _adapter_of(self, slot: int, what: str) -> str | None:
        """The adapter of a row on device slot `slot`; while merged, AssertionError unless
        it is the merged adapter's."""
        if self._merged is not None and (slot < 0 or self._loaded.get(slot) != self._merged):
            owner = "the base model" if slot < 0 else repr(self._loaded.get(slot))
            raise AssertionError(
                f"{what} of adapter slot {slot} ({owner}) while {self._merged!r} is merged: "
                "only the merged adapter's rows may run"
            )
        return self._merged or self._slots.get(slot)

    # -- adapters --------------------------------------------------------------------

    def stage_adapter(self, name: str, path: str, *, expect_sha256: str | None = None) -> Adapter:
        spec = read_adapter_config(path)
        weights = Path(path) / WEIGHTS_FILE
        size = weights.stat().st_size if weights.is_file() else 0
        digest = sha256_of(weights) if size else ""
        check_sha256(expect_sha256, digest, adapter=name, source=weights)
        if spec.rank > self.config.max_lora_rank:
            raise InvalidRequest(
                f"adapter {name!r} has rank r={spec.rank}, above this engine's "
                f"max_lora_rank={self.config.max_lora_rank}",
                field="path",
            )
        staged = dataclasses.replace(
            spec,
            name=name,
            path=str(path),
            sha256=digest,
            size_bytes=size,
            device_bytes=self.rank_row_bytes * spec.rank,
        )
        self._staged[name] = staged
        return staged

    def drop_adapter(self, name: str) -> None:
        del self._staged[name]

    def load_adapter(self, name: str, slot: int, pages: Sequence[int] | None = None) -> Payload:
        if self.load_latency:
            time.sleep(self.load_latency)
        if name in self.fail_loads:
            raise RuntimeError(f"the transfer of {name!r} broke (MockEngine fail_loads)")
        self._loaded[slot] = name
        return name

    def install_adapter(self, name: str, slot: int, payload: Payload) -> None:
        self._slots[slot] = name

    # -- KV blocks to and from host memory -------------------------------------------

    @property
    def can_swap_kv(self) -> bool:
        return True

    def kv_snapshot(self, blocks: Sequence[int]) -> object:
        return [list(self._kv[block]) for block in blocks]

    def kv_to_host(self, snapshot: object) -> HostBlocks:
        records = cast(list[list[KVRecord]], snapshot)
        started = time.perf_counter()
        nbytes = len(records) * self.kv_block_bytes
        wait_for_link(nbytes, self.config.emulated_link_gbps, started)
        return HostBlocks(len(records), nbytes, records)

    def kv_to_device(self, host: HostBlocks) -> object:
        started = time.perf_counter()
        staged = [list(block) for block in cast(list[list[KVRecord]], host.data)]
        wait_for_link(host.nbytes, self.config.emulated_link_gbps, started)
        return staged

    def kv_restore(self, blocks: Sequence[int], staged: object) -> None:
        records = cast(list[list[KVRecord]], staged)
        if len(blocks) != len(records):
            raise AssertionError(f"kv_restore of {len(records)} staged blocks into {len(blocks)}")
        for block, held in zip(blocks, records, strict=True):
            self._kv[block] = list(held)

    # -- merged inference --------------------------------------------------------------

    @property
    def can_merge(self) -> bool:
        return self.config.max_loras > 0

    @property
    def merged(self) -> str | None:
        return self._merged

    def merge(self, name: str) -> None:
        if self._merged is not None:
            raise AssertionError(f"merge({name!r}): {self._merged!r} is merged; unmerge first")
        if name not in self._staged:
            raise AssertionError(f"merge({name!r}): no such adapter is staged")
        if self.merge_latency:
            time.sleep(self.merge_latency)
        self._merged = name

    def unmerge(self) -> None:
        if self._merged is None:
            raise AssertionError("unmerge(): no adapter is merged")
        self._merged = None

    def memory(self) -> Memory:
        return Memory(
            kv_block_bytes=self.kv_block_bytes,
            lora_slot_bytes=self.rank_row_bytes * self.config.max_lora_rank,
        )


def mock_adapter_dir(rank: int, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> Path:
    """A PEFT adapter directory with only an adapter_config.json (what MockEngine reads),
    written once per process-shared temporary directory."""
    root = Path(tempfile.gettempdir()) / f"jlora-mock-adapters-{os.getuid()}"
    directory = root / f"r{rank}-{'-'.join(targets)}"
    if not (directory / "adapter_config.json").is_file():
        write_adapter_config(directory, rank=rank, targets=targets)
    return directory


def write_adapter_config(
    directory: Path, *, rank: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj"), **fields
) -> Path:
    """A config-only PEFT directory (atomically, so concurrent writers agree)."""
    import json

    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        **fields,
    }
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent))
    (staging / "adapter_config.json").write_text(json.dumps(config))
    try:
        staging.rename(directory)
    except OSError:  # written meanwhile by another process, or already there
        (staging / "adapter_config.json").unlink()
        staging.rmdir()
        if not (directory / "adapter_config.json").is_file():
            raise
    return directory


def mock_engine(*, adapters: Mapping[str, int] | None = None, **options: object) -> Orchestrator:
    """The orchestrator over a `MockEngine(**options)`, with `adapters` (name -> rank)
    registered from config-only directories."""
    engine = Orchestrator(MockEngine(**options))  # type: ignore[arg-type]
    for name, rank in (adapters or {}).items():
        engine.register_adapter(name, mock_adapter_dir(rank))
    return engine
