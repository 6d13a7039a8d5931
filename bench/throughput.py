"""Prefill and decode throughput of jlora next to Hugging Face transformers, on CPU.

Run: `python -m bench.throughput [--quick] [--json PATH]` (about 9 minutes on two
idle cores; --quick: T = 32, 128, B = 1, 8, L = 64, N = 16, 2 repetitions instead of 5).

Both systems run SmolLM2-135M-Instruct from the same GGUF file (Q4_1 tensors
dequantized to fp32) in one process, on identical token ids: a fixed English
passage tokenized by jlora's tokenizer and tiled to the lengths needed (each row of
a batch starts at a different offset, so rows differ). Two phases are timed:

1. Prefill of one prompt of T tokens (T = 32, 128, 512; shape `1xT`).
   jlora: one `engine.step()` for a request with max_tokens=1, i.e. admission, one
   compiled prefill call at bucket T (T is a power of two, so nothing is padded)
   and greedy sampling of the first token; the request then finishes without a
   decode step. The engine keeps no prefix cache (cache_policy="none"), so each
   repetition computes the whole prompt again. transformers: one forward pass over
   [1, T] with use_cache=True and logits_to_keep=1 (last-position logits only, as
   `generate` does).
   Reported: prompt tokens per second.
2. Decode of B prompts of L tokens, N new greedy tokens each, EOS ignored
   (B = 1, 8, 32; L = 128; N = 64; shape `Bx(L+N)`). jlora: an engine with
   max_slots=B; the first step (every prefill, then the first decode) is not timed,
   then N steps of one compiled decode call over the B slots are. transformers: an
   untimed prefill of the [B, L] batch (equal lengths, so no padding or mask), then
   N timed forward passes of the last tokens with past_key_values.
   Reported: generated tokens per second (B * N / decode time).
jlora is timed through `Orchestrator.step()`, so its host work per step (scheduling,
block tables, detokenization) counts, as it does when serving.

Fairness: jlora's compilation (`engine.warmup`) and one untimed repetition of each
measurement on both sides are excluded. torch uses one thread per core; XLA's CPU
client uses every core by default. Within each repetition the two systems run
back to back, so background load hits both; the table shows the median over
repetitions, the min-max range, and jlora / transformers. The header gives the
machine's load average before and after: on a busy shared machine, torch's
OpenMP threads suffer more than XLA's pool, so wide ranges mean "run it again".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import transformers

from bench.baselines import hf_model
from bench.lib import report
from bench.lib.timing import Measurement, compare, jlora_decode, make_prompts, write_report
from configs import EngineConfig, load_preset
from jlora.device.llama_engine import build_engine
from jlora.engine.api import Request, SamplingParams
from jlora.engine.orchestrator import Orchestrator
from jlora.model.loading import LoadedModel, load_model

MODEL = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class Plan:
    prefill_lengths: tuple[int, ...]
    batch_sizes: tuple[int, ...]  # must include 1: that engine also serves the prefills
    decode_prompt_len: int
    new_tokens: int
    repeats: int  # timed repetitions, after one untimed

    @property
    def decoded_len(self) -> int:
        """Longest decoded sequence: prompt, the untimed first two tokens, then N."""
        return self.decode_prompt_len + self.new_tokens + 2

    @property
    def max_seq_len(self) -> int:
        """The smallest power of two that holds every prompt and decoded sequence."""
        longest = max(max(self.prefill_lengths) + 1, self.decoded_len)
        return 1 << (longest - 1).bit_length()


FULL = Plan((32, 128, 512), batch_sizes=(1, 8, 32), decode_prompt_len=128, new_tokens=64, repeats=5)
QUICK = Plan((32, 128), batch_sizes=(1, 8), decode_prompt_len=64, new_tokens=16, repeats=2)


# -- jlora ----------------------------------------------------------------------


def make_engine(loaded: LoadedModel, slots: int, plan: Plan) -> Orchestrator:
    engine = build_engine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        engine_config=EngineConfig(
            max_slots=slots,
            max_seq_len=plan.max_seq_len,
            # Every prompt of a decode batch is prefilled in the first, untimed step.
            prefill_token_budget=max(slots * plan.decode_prompt_len, plan.max_seq_len),
            # No prefix cache: each repetition prefills its whole prompt, as transformers
            # does (a cache hit would skip all but the prompt's last block).
            cache_policy="none",
        ),
    )
    prompt_lengths = [plan.decode_prompt_len]
    if slots == 1:
        prompt_lengths += plan.prefill_lengths
    engine.warmup(prompt_lengths=prompt_lengths, max_length=plan.decoded_len)
    return engine


def jlora_prefill(engine: Orchestrator, prompt: list[int]) -> float:
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request(Request(uuid.uuid4().hex, prompt, sampling))
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    assert not engine.has_unfinished, "a max_tokens=1 request should finish at its prefill"
    return elapsed


# -- transformers ---------------------------------------------------------------


def load_transformers() -> torch.nn.Module:
    return hf_model.model(load_preset(MODEL).weights.resolve_path())


def transformers_prefill(model: torch.nn.Module, prompt: list[int]) -> float:
    input_ids = torch.tensor([prompt])
    start = time.perf_counter()
    model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def transformers_decode(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    output = model(input_ids=torch.tensor(prompts), use_cache=True, logits_to_keep=1)
    start = time.perf_counter()
    for _ in range(new_tokens):
        next_ids = output.logits[:, -1].argmax(dim=-1, keepdim=True)
        output = model(input_ids=next_ids, past_key_values=output.past_key_values, use_cache=True)
    return time.perf_counter() - start


# -- measurement and report -----------------------------------------------------


def machine_facts() -> dict[str, Any]:
    return {
        **report.machine_facts(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
    }


def render(facts: dict[str, str | int | float], measurements: list[Measurement]) -> str:
    baseline = {
        (m.phase, m.shape): m.tokens_per_s for m in measurements if m.system == "transformers"
    }
    lines = [
        f"SmolLM2-135M fp32 | {facts['cpu_count']} CPUs ({facts['cpu_model']}) | "
        f"jax {facts['jax']} ({facts['jax_backend']}) | torch {facts['torch']} "
        f"({facts['torch_threads']} threads) | transformers {facts['transformers']} | "
        f"{facts['date']} | 1-min load avg {facts['load_avg_1min_start']:.1f} at start, "
        f"{facts['load_avg_1min_end']:.1f} at end",
        "",
        "| system | phase | shape | tokens/s | range | ratio |",
        "|---|---|---|---:|---:|---:|",
    ]
    for m in measurements:
        ratio = (
            f"{m.tokens_per_s / baseline[(m.phase, m.shape)]:.2f}" if m.system == "jlora" else ""
        )
        spread = f"{m.tokens / max(m.seconds):.1f}-{m.tokens / min(m.seconds):.1f}"
        lines.append(
            f"| {m.system} | {m.phase} | {m.shape} | {m.tokens_per_s:.1f} | {spread} | {ratio} |"
        )
    lines += [
        "",
        "shape: 1xT = one prompt of T tokens; Bx(L+N) = B prompts of L tokens, "
        "N generated each. ratio = jlora / transformers (medians).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter prompts, fewer tokens")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write raw results here")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL

    torch.set_num_threads(os.cpu_count() or 1)
    facts = machine_facts()
    print("loading both models and compiling jlora's steps...", file=sys.stderr, flush=True)
    loaded = load_model(MODEL)
    hf_model = load_transformers()
    engines = {batch: make_engine(loaded, batch, plan) for batch in plan.batch_sizes}

    measurements: list[Measurement] = []
    with torch.inference_mode():
        for length in plan.prefill_lengths:
            [prompt] = make_prompts(loaded, 1, length)
            measurements += compare(
                "prefill", f"1x{length}", length, plan.repeats,
                jlora=functools.partial(jlora_prefill, engines[1], prompt),
                transformers=functools.partial(transformers_prefill, hf_model, prompt),
            )  # fmt: skip
        new = plan.new_tokens
        for batch in plan.batch_sizes:
            prompts = make_prompts(loaded, batch, plan.decode_prompt_len)
            measurements += compare(
                "decode", f"{batch}x({plan.decode_prompt_len}+{new})", batch * new, plan.repeats,
                jlora=functools.partial(jlora_decode, engines[batch], prompts, new),
                transformers=functools.partial(transformers_decode, hf_model, prompts, new),
            )  # fmt: skip
    facts["load_avg_1min_end"] = os.getloadavg()[0]

    print(render(facts, measurements))
    if args.json:
        write_report(args.json, facts, plan, measurements)


if __name__ == "__main__":
    main()
