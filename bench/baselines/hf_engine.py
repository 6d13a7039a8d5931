"""The PyTorch baseline's model side: transformers + PEFT running one static batch of
mixed-adapter requests at a time, on one thread (`HfEngine.run_batch`). The HTTP server
around it, and why the batching is static, are in `bench.baselines.hf_server`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.baselines import hf_model
from jlora.engine.detokenizer import Detokenizer

log = logging.getLogger("hf_server")

# PEFT's adapter name for the base-model rows of a mixed batch (peft 0.21,
# `peft/tuners/lora/layer.py`, `LoraLayer._mixed_batch_forward`).
BASE_ROW = "__base__"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- host state ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One generated token's text (may be empty while a character or a possible stop
    string is incomplete). finish_reason: "length" or "stop" on a row's last chunk."""

    text: str
    finish_reason: str | None
    completion_tokens: int


@dataclasses.dataclass(eq=False)
class Job:
    """One request. The torch thread reads the fields; `events` (None for warm-up jobs)
    is read by the request's handler only."""

    adapter: str  # a PEFT adapter name, or BASE_ROW
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    events: asyncio.Queue[Chunk | Exception] | None = None  # an Exception: the batch failed
    cancelled: bool = False  # set when the handler ends: the row stops streaming


class _Row:
    """A job's progress in the running batch (torch thread only)."""

    def __init__(self, job: Job, engine: HfEngine) -> None:
        self.job = job
        self.detokenizer = Detokenizer(engine, job.stop)
        self.generated = 0
        self.done = False
        self.generator: torch.Generator | None = None
        if job.temperature > 0:
            seed = job.seed if job.seed is not None else random.getrandbits(63)
            self.generator = torch.Generator().manual_seed(seed)

    def advance(self, token: int, eos_ids: frozenset[int]) -> Chunk:
        self.generated += 1
        text, hit_stop = self.detokenizer.add(token)
        finish = None
        if hit_stop or (token in eos_ids and not self.job.ignore_eos):
            finish = "stop"
        elif self.generated >= self.job.max_tokens:
            finish = "length"
        if finish is not None:
            self.done = True
            if not hit_stop:
                text += self.detokenizer.flush()
        return Chunk(text, finish, self.generated)


# -- the model -------------------------------------------------------------------------


class HfEngine:
    """transformers + PEFT: the model, its adapters and its tokenizer, running one static
    batch at a time (`run_batch`, on one thread).

    adapters: served name -> PEFT directory. Each is loaded under the PEFT name
    `self.peft_names[name]` ("lora0", "lora1", ...: PEFT's names cannot hold a ".").
    """

    def __init__(self, gguf_path: Path, adapters: dict[str, Path], dtype: torch.dtype) -> None:
        from peft import PeftModel

        base = hf_model.model(gguf_path, dtype)
        self.tokenizer = hf_model.tokenizer(gguf_path)
        self.peft_names = {name: f"lora{i}" for i, name in enumerate(adapters)}
        model: Any = base
        for index, (name, path) in enumerate(adapters.items()):
            log.info("loading adapter %s from %s", name, path)
            if index == 0:
                model = PeftModel.from_pretrained(
                    base, str(path), adapter_name=self.peft_names[name]
                )
            else:
                model.load_adapter(str(path), adapter_name=self.peft_names[name])
        self.model = model.eval()
        # The model's generation config, not the tokenizer: transformers' GGUF tokenizer
        # reports <|im_start|> as SmolLM2's EOS; the config has <|im_end|>, as jlora does.
        eos = base.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        pad = base.generation_config.pad_token_id
        self.pad_id = pad if isinstance(pad, int) else 0
        self.max_len: int = base.config.max_position_embeddings
        self.stopping = False  # set at shutdown: the running batch ends after its step

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(
            self.tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        )

    @torch.inference_mode()
    def run_batch(
        self, jobs: Sequence[Job], deliver: Callable[[list[tuple[Job, Chunk]]], None]
    ) -> None:
        """Generate for `jobs` as one static batch; after each step, `deliver` gets the
        (job, chunk) of every row that was still running."""
        rows = [_Row(job, self) for job in jobs]
        width = max(len(job.prompt_ids) for job in jobs)
        input_ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(jobs), width), dtype=torch.long)  # [B, T], 0 on left padding
        for index, job in enumerate(jobs):
            input_ids[index, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            mask[index, width - len(job.prompt_ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T], 0 on padding as in generate
        peft_args = {"adapter_names": [job.adapter for job in jobs]} if self.peft_names else {}
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **peft_args,
        )
        while True:
            tokens = self._sample(out.logits[:, -1], rows)  # [B]
            chunks = []
            for row, token in zip(rows, tokens.tolist(), strict=True):
                row.done = row.done or row.job.cancelled
                if not row.done:
                    chunks.append((row.job, row.advance(token, self.eos_ids)))
            deliver(chunks)
            if self.stopping or all(row.done for row in rows):
                return
            mask = torch.cat([mask, mask.new_ones((len(jobs), 1))], dim=1)
            positions = positions[:, -1:] + 1  # [B, 1]
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
                **peft_args,
            )

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """logits: f[B, vocab] -> i64[B]: argmax, or a draw at the row's temperature."""
        tokens = logits.argmax(-1)
        for index, row in enumerate(rows):
            if row.generator is not None and not row.done:
                probs = torch.softmax(logits[index].float() / row.job.temperature, dim=-1)
                tokens[index] = torch.multinomial(probs, 1, generator=row.generator)[0]
        return tokens

    def warm_up(self) -> None:
        """One short batch over the base model and every adapter (first-call costs)."""
        prompt = self.encode("Hello")
        names = [BASE_ROW, *self.peft_names.values()]
        self.run_batch([Job(name, prompt, max_tokens=2) for name in names], lambda chunks: None)
