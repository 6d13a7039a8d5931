"""`jlora generate`: run prompts through the engine and print the completions.

Three forms: `--prompt TEXT` streams one completion to stdout; `--prompts-file FILE`
runs one prompt per line in one continuous batch and prints the completions in input
order (`--output jsonl`: one JSON object per prompt with prompt, adapter, text,
token_ids, finish_reason and cached_tokens, the prompt tokens the prefix cache served);
with neither, an interactive session reads prompts from stdin (`--chat` keeps the
conversation). `--cache-policy`, `--pool-size` and `--host-pool-mib` set how the engine
shares device memory between KV blocks and adapters and keeps history KV.

Adapters: `--adapter PATH_OR_NAME` applies one PEFT adapter to every prompt (a
directory, or a name under `--adapters-dir`).

A prompts file named `*.jsonl` holds one JSON object per line, so one batch mixes
adapters and settings and a trace replays as is: `{"prompt": ..., "adapter": ...}`
(`"adapter": null` is the base model; a missing field means `--adapter`), and any of
`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop` (a string or a list of
strings) and `ignore_eos` (true or false), each in place of its flag for that prompt
(missing or null: the flag's value; a line's `stop` replaces the `--stop` strings), and
any other field of `SamplingParams` (`repetition_penalty`, `min_tokens`, `logit_bias`
as {"token id": bias}, `stop_token_ids`, `logprobs`, ...).
Any other key, a value of the wrong JSON type or out of range is refused, naming the
line and the key, before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jlora.cli.common import (
    UsageError,
    add_cache_args,
    add_lora_engine_args,
    add_model_args,
    add_sharding_args,
    cache_config,
    load_model_reporting,
    lora_engine_config,
    resolve_dtype,
    sharding_config,
)
from jlora.contract.adapters import resolve_adapter_dir
from jlora.contract.errors import InvalidRequest, RequestError
from jlora.engine.api import Request, SamplingParams, TokenEvent
from jlora.engine.orchestrator import Orchestrator

# The keys of a *.jsonl prompts file's line: the prompt, its adapter and its sampling
# (SamplingParams' fields, which the flags of the same names set for the whole file).
SAMPLING_KEYS = tuple(field.name for field in dataclasses.fields(SamplingParams))
LINE_KEYS = ("prompt", "adapter", *SAMPLING_KEYS)


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
        help="one prompt per line (blank lines are skipped), batched together; a *.jsonl "
        "file holds a JSON object per line with the prompt and, optionally, its own "
        f"{', '.join(LINE_KEYS[1:])} (missing: the flags' values)",
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
    add_sharding_args(parser)
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
    add_cache_args(engine)
    lora = parser.add_argument_group("adapters")
    lora.add_argument(
        "--adapter",
        metavar="PATH_OR_NAME",
        help="a PEFT adapter directory (or a name under --adapters-dir) for every prompt",
    )
    lora.add_argument(
        "--adapters-dir", type=Path, metavar="DIR", help="where adapter names are looked up"
    )
    add_lora_engine_args(lora)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for flag, value, low in (
        ("--max-seq-len", args.max_seq_len, 16),
        ("--max-slots", args.max_slots, 1),
        ("--max-loras", args.max_loras, 1),
    ):
        if value is not None and value < low:
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
        prompts = _read_prompts(args.prompts_file, args.adapter, sampling)
    elif args.prompt is not None:
        prompts = [Prompt(args.prompt, args.adapter, sampling)]
    else:
        prompts = []  # interactive: one conversation at a time
    adapters = _resolve_adapters(
        [p.adapter for p in prompts] if prompts else [args.adapter], args.adapters_dir
    )
    make_engine, encode = _load(args, adapters)
    served = {given: name for given, (name, _) in adapters.items()}
    engine = make_engine(min(args.max_slots, len(prompts)) if prompts else 1)
    try:
        if not prompts:
            return _interactive(
                engine,
                encode,
                sampling,
                chat=args.chat,
                system=args.system,
                adapter=served.get(args.adapter or ""),
            )
        return _run_batch(
            engine,
            encode,
            prompts,
            served,
            args.output,
            stream=args.prompt is not None and args.output == "text",
        )
    finally:
        engine.close()


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    adapter: str | None  # as given: a path or a name; None is the base model
    sampling: SamplingParams


def _read_prompts(
    path: Path, default_adapter: str | None, default_sampling: SamplingParams
) -> list[Prompt]:
    if not path.is_file():
        raise UsageError(f"--prompts-file {path}: no such file")
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not lines:
        raise UsageError(f"--prompts-file {path}: no prompts (every line is blank)")
    if path.suffix != ".jsonl":
        return [Prompt(line, default_adapter, default_sampling) for _, line in lines]
    prompts = []
    for number, line in lines:
        where = f"--prompts-file {path} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(item, dict):
            raise UsageError(f"{where}: expected a JSON object with a 'prompt' field")
        if unknown := sorted(set(item) - set(LINE_KEYS)):
            raise UsageError(f"{where}: unknown fields {unknown} (expected {', '.join(LINE_KEYS)})")
        text = item.get("prompt")
        if not isinstance(text, str) or not text:
            raise UsageError(f"{where}: prompt={text!r} must be a non-empty string")
        adapter = item.get("adapter", default_adapter)
        if adapter is not None and (not isinstance(adapter, str) or not adapter):
            raise UsageError(f"{where}: adapter={adapter!r} must be a non-empty string or null")
        prompts.append(Prompt(text, adapter, _line_sampling(item, default_sampling, where)))
    return prompts


def _line_sampling(item: dict[str, Any], default: SamplingParams, where: str) -> SamplingParams:
    """`default` (the flags' settings) with the line's own sampling keys in their place;
    UsageError naming `where` and the key if one is refused."""
    given = {key: item[key] for key in SAMPLING_KEYS if item.get(key) is not None}
    if "stop" in given:  # SamplingParams takes a tuple of strings; JSON offers more
        stop = [given["stop"]] if isinstance(given["stop"], str) else given["stop"]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise UsageError(
                f"{where}: stop={item['stop']!r} must be a string or a list of strings"
            )
        given["stop"] = tuple(stop)
    for key in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if not isinstance(given.get(key, False), bool):
            raise UsageError(f"{where}: {key}={item[key]!r} must be true or false")
    if "logit_bias" in given:
        bias = given["logit_bias"]
        if not isinstance(bias, dict) or not all(str(k).isdigit() for k in bias):
            raise UsageError(f"{where}: logit_bias={bias!r} must map token ids to biases")
        given["logit_bias"] = tuple(sorted((int(k), v) for k, v in bias.items()))
    if "stop_token_ids" in given:
        ids = given["stop_token_ids"]
        if not isinstance(ids, list):
            raise UsageError(f"{where}: stop_token_ids={ids!r} must be a list of token ids")
        given["stop_token_ids"] = tuple(ids)
    try:
        return dataclasses.replace(default, **given)
    except InvalidRequest as err:
        raise UsageError(f"{where}: {err.message}") from None


def _resolve_adapters(
    given: list[str | None], adapters_dir: Path | None
) -> dict[str, tuple[str, Path]]:
    """Each distinct adapter as given -> (the name it is served under, its PEFT directory).

    The name is the directory's own name, made unique; UsageError if there is no directory.
    """
    resolved: dict[str, tuple[str, Path]] = {}
    for spec in dict.fromkeys(a for a in given if a is not None):
        path = Path(spec).expanduser()
        if not path.is_dir() and adapters_dir is not None:
            try:  # a name under the directory, which it may not leave
                path = resolve_adapter_dir(spec, adapters_dir, field="--adapter")
            except RequestError as err:
                raise UsageError(err.message) from None
        if not path.is_dir():
            where = f" nor in --adapters-dir {adapters_dir}" if adapters_dir else ""
            raise UsageError(f"--adapter {spec}: no such adapter directory{where}")
        name = re.sub(r"[^A-Za-z0-9._-]", "-", path.resolve().name).lstrip("._-")[:120] or "a"
        taken = {n for n, _ in resolved.values()}
        unique = next(c for c in [name, *(f"{name}-{i}" for i in range(2, 1000))] if c not in taken)
        resolved[spec] = (unique, path)
    return resolved


Encoder = Callable[[list[dict[str, str]] | str], list[int]]


def _load(
    args: argparse.Namespace, adapters: dict[str, tuple[str, Path]]
) -> tuple[Callable[[int], Orchestrator], Encoder]:
    """The model's tokenizer as an encoder, and an engine factory taking the slot count
    (the engine serves `adapters`, registered under the names the user gave)."""
    from configs import EngineConfig
    from jlora.contract.peft import read_adapter_config
    from jlora.device.llama_engine import build_engine

    specs = [read_adapter_config(path) for _, path in adapters.values()]  # fail before loading
    lora: dict[str, Any] = {}
    if specs:
        lora = {
            "max_loras": args.max_loras or len(specs),
            "max_lora_rank": max(spec.rank for spec in specs),
            "lora_targets": tuple({t for spec in specs for t in spec.targets}),
            **lora_engine_config(args),
        }
    sharding = sharding_config(args)
    loaded = load_model_reporting(args.model, args.dtype, sharding)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise UsageError(
            f"--model {args.model}: this model has no tokenizer "
            "(random-weight presets are for benchmarks that feed token ids)"
        )
    max_seq_len = min(args.max_seq_len, loaded.config.max_context)

    def make_engine(slots: int) -> Orchestrator:
        config = EngineConfig(
            dtype=resolve_dtype(args.dtype),
            max_slots=slots,
            max_seq_len=max_seq_len - max_seq_len % 16,
            sharding=sharding,
            layer_loop=args.layer_loop,
            decode_attention=args.decode_attention,
            **cache_config(args),
            **lora,
        )
        engine = build_engine(
            model_config=loaded.config,
            params=loaded.params,
            tokenizer=tokenizer,
            engine_config=config,
        )
        try:
            for name, path in adapters.values():
                engine.register_adapter(name, path)
        except BaseException:
            engine.close()
            raise
        return engine

    def encode(prompt: list[dict[str, str]] | str) -> list[int]:
        if isinstance(prompt, list):  # a conversation
            return tokenizer.encode(tokenizer.apply_chat_template(prompt))
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            return encode([*messages, {"role": "user", "content": prompt}])
        return tokenizer.encode(prompt)

    return make_engine, encode


def _run_batch(
    engine: Orchestrator,
    encode: Encoder,
    prompts: list[Prompt],
    served: dict[str, str],
    output: str,
    stream: bool = False,
) -> int:
    """Run `prompts` in one batch; `served` maps each adapter as given to its served name."""
    requests = [
        Request(str(i), encode(p.text), p.sampling, adapter=served.get(p.adapter or ""))
        for i, p in enumerate(prompts)
    ]
    for i, request in enumerate(requests):  # validate every prompt before running any
        try:
            engine.add_request(request)
        except RequestError as err:
            for queued in requests[:i]:
                engine.abort(queued.request_id)
            where = f"prompt {i + 1}: " if len(prompts) > 1 else ""
            raise UsageError(f"{where}{err.message}") from err
    # One run: each shape compiles when first needed, so the first token comes sooner
    # and a shape the run never meets (a long answer's decode bucket) never compiles.
    engine.warmup(prompt_lengths=[len(r.prompt_ids) for r in requests], on_demand=True)
    results: dict[str, dict] = {
        r.request_id: {"text": [], "token_ids": [], "cached_tokens": 0} for r in requests
    }
    printed = 0
    failed = 0
    while engine.has_unfinished:
        for event in engine.step():
            result = results[event.request_id]
            if event.error is not None:
                failed += 1
                result["error"] = event.error.message
                print(f"jlora: error: prompt {int(event.request_id) + 1}: {event.error.message}",
                      file=sys.stderr)  # fmt: skip
            else:
                result["text"].append(event.text)
                result["token_ids"].append(event.token_id)
                result["cached_tokens"] += event.cached_tokens
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
                            "prompt": prompts[printed].text,
                            "adapter": prompts[printed].adapter,
                            "text": text,
                            "token_ids": result["token_ids"],
                            "finish_reason": result["finish_reason"],
                            "cached_tokens": result["cached_tokens"],
                            **({"error": result["error"]} if "error" in result else {}),
                        }
                    ),
                    flush=True,
                )
            else:
                print("" if stream else text, flush=True)
            printed += 1
    return 1 if failed else 0


def _interactive(
    engine: Orchestrator,
    encode: Encoder,
    sampling: SamplingParams,
    *,
    chat: bool,
    system: str | None,
    adapter: str | None,
) -> int:
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    engine.warmup(on_demand=True)  # a turn compiles the shapes it is the first to need
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
                Request(
                    f"turn-{turn}",
                    encode(messages if chat else line.strip()),
                    sampling,
                    adapter=adapter,
                )
            )
        except RequestError as err:
            print(f"jlora: error: {err.message}; starting a new conversation", file=sys.stderr)
            history = history[:1] if system else []
            continue
        reply = _stream_one(engine)
        if chat:
            history = [*messages, {"role": "assistant", "content": reply}]


def _stream_one(engine: Orchestrator) -> str:
    parts = []
    while engine.has_unfinished:
        event: TokenEvent
        for event in engine.step():
            if event.error is not None:
                print(f"\njlora: error: {event.error.message}", file=sys.stderr)
            sys.stdout.write(event.text)
            sys.stdout.flush()
            parts.append(event.text)
    print(flush=True)
    return "".join(parts)
