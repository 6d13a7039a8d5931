"""`jlora generate`: run prompts through the engine and print the completions.

Three forms: `--prompt TEXT` streams one completion to stdout; `--prompts-file FILE`
runs one prompt per line in one continuous batch and prints the completions in input
order (`--output jsonl`: one JSON object per prompt with prompt, text, token_ids and
finish_reason); with neither, an interactive session reads prompts from stdin
(`--chat` keeps the conversation).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from jlora.cli.common import UsageError, add_model_args, resolve_dtype
from jlora.engine.api import Engine, InvalidRequest, Request, SamplingParams, TokenEvent


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate", help="generate text from prompts", description=__doc__.splitlines()[0]
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="one prompt; its completion streams to stdout")
    source.add_argument(
        "--prompts-file",
        type=Path,
        metavar="FILE",
        help="one prompt per line (blank lines are skipped), batched together",
    )
    parser.add_argument(
        "--output",
        choices=["text", "jsonl"],
        default="text",
        help="plain text, or one JSON object per prompt",
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the model's chat template"
    )
    parser.add_argument("--system", help="system message for --chat")
    add_model_args(parser)
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=256)
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    sampling.add_argument("--seed", type=int)
    sampling.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STRING",
        help="stop at this string (repeatable)",
    )
    sampling.add_argument("--ignore-eos", action="store_true")
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--max-seq-len",
        type=int,
        default=2048,
        help="longest prompt + completion (capped at the model's context)",
    )
    engine.add_argument("--max-slots", type=int, default=8, help="decode batch size")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for flag, value, low in (
        ("--max-seq-len", args.max_seq_len, 16),
        ("--max-slots", args.max_slots, 1),
    ):
        if value < low:
            raise UsageError(f"{flag} {value}: must be at least {low}")
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    if args.prompts_file:
        prompts = _read_prompts(args.prompts_file)
    elif args.prompt is not None:
        prompts = [args.prompt]
    else:
        prompts = []  # interactive: one conversation at a time
    make_engine, encode = _load(args)
    if not prompts:
        return _interactive(make_engine(1), encode, sampling, chat=args.chat, system=args.system)
    engine = make_engine(min(args.max_slots, len(prompts)))
    return _run_batch(
        engine,
        encode,
        prompts,
        sampling,
        args.output,
        stream=args.prompt is not None and args.output == "text",
    )


def _read_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise UsageError(f"--prompts-file {path}: no such file")
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"--prompts-file {path}: no prompts (every line is blank)")
    return prompts


Encoder = Callable[[list[dict[str, str]] | str], list[int]]


def _load(args: argparse.Namespace) -> tuple[Callable[[int], Engine], Encoder]:
    """The model's tokenizer as an encoder, and an engine factory taking the slot count."""
    from configs import EngineConfig
    from jlora.engine.engine import LLMEngine
    from jlora.model.loading import load_model

    loaded = load_model(args.model, resolve_dtype(args.dtype))
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise UsageError(
            f"--model {args.model}: this model has no tokenizer "
            "(random-weight presets are for benchmarks that feed token ids)"
        )
    max_seq_len = min(args.max_seq_len, loaded.config.max_context)

    def make_engine(slots: int) -> Engine:
        config = EngineConfig(
            dtype=resolve_dtype(args.dtype),
            max_slots=slots,
            max_seq_len=max_seq_len - max_seq_len % 16,
        )
        return LLMEngine(
            model_config=loaded.config,
            params=loaded.params,
            tokenizer=tokenizer,
            engine_config=config,
        )

    def encode(prompt: list[dict[str, str]] | str) -> list[int]:
        if isinstance(prompt, list):  # a conversation
            return tokenizer.encode(tokenizer.apply_chat_template(prompt))
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            return encode([*messages, {"role": "user", "content": prompt}])
        return tokenizer.encode(prompt)

    return make_engine, encode


def _run_batch(
    engine: Engine,
    encode: Encoder,
    prompts: list[str],
    sampling: SamplingParams,
    output: str,
    stream: bool = False,
) -> int:
    requests = [Request(str(i), encode(p), sampling) for i, p in enumerate(prompts)]
    for i, request in enumerate(requests):  # validate every prompt before running any
        try:
            engine.add_request(request)
        except InvalidRequest as err:
            for queued in requests[:i]:
                engine.abort(queued.request_id)
            where = f"prompt {i + 1}: " if len(prompts) > 1 else ""
            raise InvalidRequest(f"{where}{err}") from err
    engine.warmup(
        prompt_lengths=[len(r.prompt_ids) for r in requests],
        max_length=max(len(r.prompt_ids) + sampling.max_tokens for r in requests),
    )
    results: dict[str, dict] = {r.request_id: {"text": [], "token_ids": []} for r in requests}
    printed = 0
    while engine.has_unfinished:
        for event in engine.step():
            result = results[event.request_id]
            result["text"].append(event.text)
            result["token_ids"].append(event.token_id)
            if stream and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if event.finish_reason:
                result["finish_reason"] = event.finish_reason
        while printed < len(prompts) and "finish_reason" in results[str(printed)]:
            result = results[str(printed)]
            text = "".join(result["text"])
            if output == "jsonl":
                print(
                    json.dumps(
                        {
                            "prompt": prompts[printed],
                            "text": text,
                            "token_ids": result["token_ids"],
                            "finish_reason": result["finish_reason"],
                        }
                    ),
                    flush=True,
                )
            else:
                print("" if stream else text, flush=True)
            printed += 1
    return 0


def _interactive(
    engine: Engine, encode: Encoder, sampling: SamplingParams, *, chat: bool, system: str | None
) -> int:
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    print("jlora: compiling the engine's steps (cached after the first run)...", file=sys.stderr)
    engine.warmup()
    print("jlora: type a prompt and press Enter (Ctrl-D to quit)", file=sys.stderr)
    turn = 0
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        turn += 1
        messages = [*history, {"role": "user", "content": line.strip()}]
        try:
            engine.add_request(
                Request(f"turn-{turn}", encode(messages if chat else line.strip()), sampling)
            )
        except InvalidRequest as err:
            print(f"jlora: error: {err}; starting a new conversation", file=sys.stderr)
            history = history[:1] if system else []
            continue
        reply = _stream_one(engine)
        if chat:
            history = [*messages, {"role": "assistant", "content": reply}]


def _stream_one(engine: Engine) -> str:
    parts = []
    while engine.has_unfinished:
        event: TokenEvent
        for event in engine.step():
            sys.stdout.write(event.text)
            sys.stdout.flush()
            parts.append(event.text)
    print(flush=True)
    return "".join(parts)
