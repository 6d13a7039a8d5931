"""`jlora profile`: fit the router's performance models on this worker's hardware.

Toppings §5: the latency of an iteration is linear in one number of the batch's ranks,
|S|·max r for BGMV and Σr for MBGMV. This command runs an engine (the model, the LoRA
backend and the dtype a worker would serve) through:

1. decode steps of batches of every size in `--batches`, each with every uniform rank
   of `--ranks` and one mix cycling through them (the median of `--repeats` steps
   after the batch has been prefilled);
2. prefills of every prompt length in `--prompt-lens` at every rank (max_tokens 1, so
   the step that admits the request is its prefill alone);

fits α and β (and γ per prefill token, `router.perf_model`) by least squares, prints
each model with its R², and writes the JSON that `jlora router --profile` loads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jlora.cli.common import (
    UsageError,
    add_model_args,
    add_sharding_args,
    load_model_reporting,
    resolve_dtype,
    sharding_config,
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "profile",
        help="fit the router's performance models on this machine",
        description=__doc__.splitlines()[0],
    )
    add_model_args(parser)
    add_sharding_args(parser)
    parser.add_argument("--out", type=Path, required=True, help="the profile JSON to write")
    parser.add_argument(
        "--lora-backend", choices=["reference", "bgmv", "mbgmv"], default="reference"
    )
    parser.add_argument(
        "--kind",
        choices=["bgmv", "mbgmv"],
        help="the model form (default: mbgmv for the mbgmv backend, else bgmv)",
    )
    parser.add_argument("--batches", default="1,2,4,8", help="decode batch sizes")
    parser.add_argument("--ranks", default="8,16,32,64", help="adapter ranks")
    parser.add_argument("--prompt-lens", default="32,64,128", help="prefill lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.set_defaults(run=run)


def _ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} {text!r}: every value must be at least 1")
    return values


def model_kind(backend: str, kind: str | None) -> str:
    """The performance model's form: `--kind`, else mbgmv for the mbgmv backend, else
    bgmv."""
    return kind or ("mbgmv" if backend == "mbgmv" else "bgmv")


def run(args: argparse.Namespace) -> int:
    batches = _ints("--batches", args.batches)  # the flags before JAX is imported
    ranks = _ints("--ranks", args.ranks)
    prompt_lens = _ints("--prompt-lens", args.prompt_lens)
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: must be at least 1")
    kind = model_kind(args.lora_backend, args.kind)
    sharding = sharding_config(args)

    from configs import EngineConfig
    from jlora.adapters.peft import make_demo_adapters
    from jlora.device.llama_engine import build_engine
    from jlora.engine.api import Request, SamplingParams
    from router.perf_model import PerfProfile, fit

    loaded = load_model_reporting(args.model, args.dtype, sharding)
    longest = max(prompt_lens) + args.repeats + 2
    max_seq_len = -(-longest // 16) * 16
    if max_seq_len > loaded.config.max_context:
        raise UsageError(f"--prompt-lens: {max(prompt_lens)} exceeds the model's context")
    config = EngineConfig(
        dtype=resolve_dtype(args.dtype),
        max_slots=max(batches),
        max_seq_len=max_seq_len,
        max_loras=len(ranks),
        max_lora_rank=max(ranks),
        lora_mode="cached",
        lora_backend=args.lora_backend,
        sharding=sharding,
        layer_loop=args.layer_loop,
        decode_attention=args.decode_attention,
    )
    engine = build_engine(
        model_config=loaded.config, params=loaded.params, tokenizer=None, engine_config=config
    )
    vocab = loaded.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_demo_adapters(loaded.config, tmp, n=len(ranks), ranks=ranks, seed=0)
        by_rank = {rank: path.name for rank, path in zip(ranks, paths, strict=True)}
        for path in paths:
            engine.register_adapter(path.name, path)
    print("jlora profile: compiling...", file=sys.stderr, flush=True)
    engine.warmup()
    count = 0

    def request(rank: int, length: int, max_tokens: int) -> Request:
        nonlocal count
        count += 1
        prompt = [(count * 7919 + i) % vocab for i in range(length)]
        return Request(f"p{count}", prompt, SamplingParams(max_tokens=max_tokens,
                       ignore_eos=True), adapter=by_rank[rank])  # fmt: skip

    decode_batches, decode_ms = [], []
    try:
        for size in batches:
            mixes = [[rank] * size for rank in ranks] + [
                [ranks[i % len(ranks)] for i in range(size)]
            ]
            for mix in mixes:
                for rank in mix:
                    engine.add_request(request(rank, 8, args.repeats + 2))
                engine.step()  # prefills the batch (and decodes its first step)
                samples = []
                while engine.has_unfinished:
                    start = time.perf_counter()
                    engine.step()
                    samples.append(1e3 * (time.perf_counter() - start))
                decode_batches.append(mix)
                decode_ms.append(statistics.median(samples))
        prefill_batches, prefill_tokens, prefill_ms = [], [], []
        for length in prompt_lens:
            for rank in ranks:
                samples = []
                for _ in range(args.repeats):
                    engine.add_request(request(rank, length, 1))
                    start = time.perf_counter()
                    while engine.has_unfinished:
                        engine.step()
                    samples.append(1e3 * (time.perf_counter() - start))
                prefill_batches.append([rank])
                prefill_tokens.append([length])
                prefill_ms.append(statistics.median(samples))
    finally:
        engine.close()
    import jax

    profile = PerfProfile(
        prefill=fit(kind, prefill_batches, prefill_ms, tokens=prefill_tokens),
        decode=fit(kind, decode_batches, decode_ms),
        device=jax.devices()[0].device_kind,
        base_model=args.model,
    )
    for name, model in (("prefill", profile.prefill), ("decode", profile.decode)):
        gamma = f" + {model.gamma:.4g} ms/token" if name == "prefill" else ""
        print(
            f"{name} ({kind}): {model.alpha:.4g} ms/unit · feature + {model.beta:.4g} ms"
            f"{gamma}, R² = {model.r2:.3f} over {model.n_samples} samples"
        )
    profile.save(args.out)
    print(f"jlora profile: wrote {args.out}", file=sys.stderr)
    return 0
