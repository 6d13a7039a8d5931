"""The PyTorch baseline: Hugging Face transformers + PEFT behind a small OpenAI-compatible
HTTP server, serving the base weights and PEFT adapters jlora serves, as a PyTorch user
would serve them.

    python -m bench.baselines.hf_server --model smollm2-135m [--adapters-dir DIR]
        [--adapter NAME=PATH ...] [--host 127.0.0.1] [--port 0] [--max-batch 8]
        [--dtype float32] [--threads N]

Startup: transformers loads the preset's GGUF file (dequantized to --dtype, as the
tests' `hf_smollm2` oracle loads it) and its tokenizer from the same file, through the
machine's copy of its conversion (`bench.baselines.hf_model`); PEFT loads
every adapter (`PeftModel.from_pretrained`, then `load_adapter`), named as `jlora serve`
names them: each subdirectory of --adapters-dir holding an adapter_config.json under
its directory name, then each --adapter NAME=PATH. One warm-up batch runs the base
model and every adapter, then `hf_server listening on http://HOST:PORT` is printed on
stdout (`LISTENING`); a few seconds on two cores, or about 30 s more the first time a
machine reads the GGUF file.
Routes: GET /v1/models, POST /v1/completions, GET /health (200 with the batches and
requests run so far; 503 if the scheduler died). SIGTERM or SIGINT: every request
still here is answered 503 (no drain) and the process exits.

A request's life:

1. The aiohttp handler, on the event loop, checks the body, tokenizes the prompt and
   puts a `Job` on the waiting queue (unbounded; nothing is refused for load).
2. The scheduler task takes the first waiting job and every other one already
   waiting, up to --max-batch, whatever their adapters, and runs the batch on the one
   torch thread. The event loop stays free to stream tokens and take new requests
   meanwhile (torch releases the GIL inside its kernels).
3. The torch thread (`HfEngine.run_batch`, under `torch.inference_mode`) left-pads the
   prompts and runs one prefill over the batch with PEFT's mixed-batch argument
   `adapter_names=[...]` (one name per row; `BASE_ROW` for base-model rows), then one
   decode step per token for the whole batch with the KV cache (`past_key_values`, the
   attention mask grown by a column, position ids counted from the mask as `generate`
   counts them). After each step, every row still running detokenizes its token
   incrementally and hands the text to its handler (`loop.call_soon_threadsafe`).
4. A row finishes at max_tokens, at EOS unless ignore_eos, or at a stop string; it
   stops streaming but stays in the batch, computing padding, until the longest row
   finishes or every client of the batch has gone. Requests that arrived meanwhile
   wait for the next batch.
5. The handler writes each token as a server-sent event (`data: {chunk}`), then the
   usage chunk if `stream_options.include_usage`, then `data: [DONE]`; or, without
   `stream`, one JSON answer.

Why static batching: it is what `model.generate(input_ids, attention_mask,
adapter_names=...)` does, the one batched generation API that PEFT's mixed-adapter
batches work with: the batch is fixed at its prefill and runs until its longest row
is done. transformers 5.17 also ships continuous batching (`generate_batch`,
`init_continuous_batching`, and `transformers serve` on top of them), but a request
there carries token ids and sampling options only, and each step flattens the batch
into one ragged row (`input_ids` of shape [1, total_tokens]), while PEFT's
`adapter_names` names one adapter per row: it serves one adapter at a time
(`set_adapter`), not a mixed batch, so it is not used here.

Limits: one batch at a time, so a request that arrives while one runs waits for its
longest row; a finished row keeps computing until its batch ends; the KV cache grows by
concatenation (DynamicCache), no paging, no prefix sharing; prompt + max_tokens must fit
the model's max_position_embeddings. Threads: one per core by default, right on a
machine to itself; beside another busy process torch's OpenMP threads wait on each
other (2 cores, one busy elsewhere: 8 rows of 64 tokens at 45 tokens/s with
--threads 1, 10 with 2), so use --threads 1 there. Sampling is greedy (temperature 0, the default)
or temperature sampling with an optional `seed`; `top_p`, `top_k`, `n`, `best_of`,
`logprobs`, `echo`, `suffix`, penalties and `logit_bias` are refused at other than
their defaults, naming the field, as are chat completions (no route). Errors are
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 naming the
field, 404 for an unknown model (`code` "model_not_found"), 500 if the batch failed
(logged with its traceback); a stream that fails after its first chunk ends with one
`data: {"error": ...}` event and no [DONE].
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from bench.baselines.hf_engine import BASE_ROW, DTYPES, Chunk, HfEngine, Job
from configs import load_preset
from configs.model import ConfigError
from jlora.cli.common import UsageError
from jlora.cli.serve import adapters_to_register

log = logging.getLogger("hf_server")

# The line printed on stdout once the server listens; group 1 is its base URL.
LISTENING = re.compile(r"hf_server listening on (http://\S+)")
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI fields not implemented here: accepted only at these values.
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None,),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "top_p": (None, 1),
    "top_k": (None, 0, -1),
}


# -- HTTP ------------------------------------------------------------------------------


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class Server:
    """The OpenAI routes over one HfEngine; `start` binds, `stop` ends."""

    def __init__(self, engine: HfEngine, base_id: str, max_batch: int) -> None:
        self.engine, self.base_id, self.max_batch = engine, base_id, max_batch
        self.waiting: asyncio.Queue[Job] = asyncio.Queue()
        self.batch: list[Job] = []  # the one running
        self.torch_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torch")
        self.created = int(time.time())
        self.stats = {"batches": 0, "requests": 0}  # served since start, warm-up excluded
        self.app = web.Application(middlewares=[self._errors])
        self.app.add_routes(
            [
                web.get("/v1/models", self.models),
                web.post("/v1/completions", self.completions),
                web.get("/health", self.health),
            ]
        )
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self.scheduler: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Serve on host:port (0: any free port); the bound port."""
        self.scheduler = asyncio.create_task(self._schedule())
        self.scheduler.add_done_callback(_report_death)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()
        return self.runner.addresses[0][1]

    async def stop(self) -> None:
        """Answer every request still here with 503 (no drain), then close."""
        self.engine.stopping = True
        if self.scheduler is not None:
            self.scheduler.cancel()
        while not self.waiting.empty():
            self.batch.append(self.waiting.get_nowait())
        for job in self.batch:
            if job.events is not None:
                job.events.put_nowait(ApiError(503, "the server is stopping", code="stopping"))
        await self.runner.cleanup()
        self.torch_thread.shutdown(wait=True)

    # -- the scheduler -----------------------------------------------------------------

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()

        def deliver(chunks: list[tuple[Job, Chunk]]) -> None:  # on the torch thread
            loop.call_soon_threadsafe(_put_all, chunks)

        while True:
            batch = [await self.waiting.get()]
            while len(batch) < self.max_batch and not self.waiting.empty():
                batch.append(self.waiting.get_nowait())
            batch = [job for job in batch if not job.cancelled]
            if not batch:
                continue
            self.stats["batches"] += 1
            self.stats["requests"] += len(batch)
            self.batch = batch
            try:
                await loop.run_in_executor(self.torch_thread, self.engine.run_batch, batch, deliver)
            except Exception as err:
                log.exception("a batch of %d requests failed", len(batch))
                for job in batch:
                    if job.events is not None:
                        job.events.put_nowait(
                            ApiError(500, f"the batch failed: {err!r}", code="internal_error")
                        )
            self.batch = []

    # -- routes ------------------------------------------------------------------------

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            return web.json_response(err.body(), status=err.status)
        except web.HTTPException as err:  # no such route, wrong method
            error = ApiError(err.status, f"{request.method} {request.path}: {err.reason}")
            return web.json_response(error.body(), status=err.status)

    async def health(self, request: web.Request) -> web.Response:
        if self.scheduler is None or self.scheduler.done():
            return web.json_response({"status": "the scheduler is not running"}, status=503)
        return web.json_response({"status": "ok", **self.stats})

    async def models(self, request: web.Request) -> web.Response:
        def entry(model_id: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": model_id,
                "object": "model",
                "created": self.created,
                "owned_by": "hf_server",
                "root": parent or model_id,
                "parent": parent,
                "max_model_len": self.engine.max_len,
            }

        data = [entry(self.base_id, None)]
        data += [entry(name, self.base_id) for name in self.engine.peft_names]
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        job = self._job(body)
        stream = _typed(body, "stream", bool, default=False)
        options = _typed(body, "stream_options", dict, default={})
        usage = _typed(options, "include_usage", bool, default=False, prefix="stream_options.")
        if self.scheduler is None or self.scheduler.done():
            raise ApiError(503, "the scheduler is not running (see the server's log)")
        shape = _Shape(body["model"], len(job.prompt_ids))
        self.waiting.put_nowait(job)
        try:
            if stream:
                return await self._stream(request, job, shape, usage)
            chunks = [await _next_chunk(job)]
            while chunks[-1].finish_reason is None:
                chunks.append(await _next_chunk(job))
            return web.json_response(shape.whole(chunks))
        finally:
            job.cancelled = True

    async def _stream(
        self, request: web.Request, job: Job, shape: _Shape, usage: bool
    ) -> web.StreamResponse:
        chunk = await _next_chunk(job)  # errors before the first token are plain HTTP errors
        sse = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await sse.prepare(request)
        while True:
            await _event(sse, shape.chunk(chunk, usage=usage))
            if chunk.finish_reason is not None:
                break
            try:
                chunk = await _next_chunk(job)
            except ApiError as err:
                await _event(sse, err.body())
                return sse
        if usage:
            await _event(sse, shape.usage_chunk(chunk))
        await sse.write(b"data: [DONE]\n\n")
        await sse.write_eof()
        return sse

    def _job(self, body: dict[str, Any]) -> Job:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(
                400, f"model={model!r} must be a model id (see /v1/models)", param="model"
            )
        if model != self.base_id and model not in self.engine.peft_names:
            raise ApiError(
                404,
                f"model={model!r} is not served here (see /v1/models)",
                param="model",
                code="model_not_found",
            )
        for field, accepted in _UNSUPPORTED.items():
            if body.get(field) not in accepted:
                raise ApiError(
                    400,
                    f"{field}={body[field]!r} is not supported (accepted: "
                    f"{', '.join(repr(value) for value in accepted)})",
                    param=field,
                )
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, f"prompt={prompt!r} must be a non-empty string", param="prompt")
        max_tokens = _typed(body, "max_tokens", int, default=DEFAULT_MAX_TOKENS)
        if isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(400, f"max_tokens={max_tokens!r} must be at least 1", param="max_tokens")
        temperature = _typed(body, "temperature", (int, float), default=0.0)
        if isinstance(temperature, bool) or not 0 <= temperature <= 100:
            raise ApiError(
                400, f"temperature={temperature!r} must be in [0, 100]", param="temperature"
            )
        seed = _typed(body, "seed", int, default=None)
        if seed is not None and (isinstance(seed, bool) or not 0 <= seed < 2**63):
            raise ApiError(400, f"seed={seed!r} must be in [0, 2**63)", param="seed")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(
                400,
                f"stop={body['stop']!r} must be a non-empty string or a list of them",
                param="stop",
            )
        prompt_ids = self.engine.encode(prompt)
        if len(prompt_ids) + max_tokens > self.engine.max_len:
            raise ApiError(
                400,
                f"max_tokens={max_tokens}: the prompt's {len(prompt_ids)} tokens plus max_tokens "
                f"exceed the model's {self.engine.max_len} positions",
                param="max_tokens",
            )
        return Job(
            adapter=self.engine.peft_names.get(model, BASE_ROW),
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            temperature=float(temperature),
            seed=seed,
            ignore_eos=_typed(body, "ignore_eos", bool, default=False),
            stop=tuple(stop),
            events=asyncio.Queue(),
        )


class _Shape:
    """OpenAI's text_completion objects for one request."""

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.model, self.prompt_tokens = model, prompt_tokens
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, text: str | None, last: Chunk) -> dict[str, Any]:
        """The object around one choice (none if `text` is None, as in the usage chunk)."""
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [] if text is None else [choice],
        }

    def usage(self, last: Chunk) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": last.completion_tokens,
            "total_tokens": self.prompt_tokens + last.completion_tokens,
        }

    def whole(self, chunks: list[Chunk]) -> dict[str, Any]:
        text = "".join(chunk.text for chunk in chunks)
        return {**self._envelope(text, chunks[-1]), "usage": self.usage(chunks[-1])}

    def chunk(self, chunk: Chunk, *, usage: bool) -> dict[str, Any]:
        """A stream chunk; with include_usage, its "usage" is null."""
        return {**self._envelope(chunk.text, chunk), **({"usage": None} if usage else {})}

    def usage_chunk(self, last: Chunk) -> dict[str, Any]:
        return {**self._envelope(None, last), "usage": self.usage(last)}


def _put_all(chunks: list[tuple[Job, Chunk]]) -> None:
    for job, chunk in chunks:
        if job.events is not None:
            job.events.put_nowait(chunk)


async def _next_chunk(job: Job) -> Chunk:
    assert job.events is not None
    event = await job.events.get()
    if isinstance(event, ApiError):
        raise event
    return event


async def _event(sse: web.StreamResponse, data: dict[str, Any]) -> None:
    await sse.write(f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode())


def _typed(
    body: dict[str, Any],
    field: str,
    kind: type | tuple[type, ...],
    *,
    default: Any,
    prefix: str = "",
) -> Any:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ApiError(
            400, f"{prefix}{field}={value!r} must be of type {names}", param=prefix + field
        )
    return value


def _report_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the scheduler died; /health answers 503", exc_info=task.exception())


# -- the command -----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.baselines.hf_server", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="smollm2-135m", help="a preset with GGUF weights")
    parser.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=PATH", help="a PEFT adapter"
    )
    parser.add_argument(
        "--adapters-dir", type=Path, metavar="DIR", help="serve every adapter directory in DIR"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--max-batch", type=int, default=8, help="requests per static batch")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, help="torch threads (default: one per core)")
    return parser


def _resolve(args: argparse.Namespace) -> tuple[Path, dict[str, Path]]:
    """The GGUF file and the adapters (served name -> directory); UsageError if bad."""
    if args.max_batch < 1 or (args.threads is not None and args.threads < 1):
        raise UsageError("--max-batch and --threads must be at least 1")
    try:
        weights = load_preset(args.model).weights
        if weights.format != "gguf":
            raise UsageError(f"--model {args.model}: a preset with GGUF weights is needed")
        gguf_path = weights.resolve_path()
    except ConfigError as err:  # an unknown preset, a weights package not installed
        raise UsageError(f"--model {args.model}: {err}") from None
    pairs = []
    for item in args.adapter:
        name, _, path = item.partition("=")
        if not name or not path:
            raise UsageError(f"--adapter {item!r}: expected NAME=PATH")
        pairs.append((name, path))
    adapters = adapters_to_register(pairs, args.adapters_dir)
    missing = [f"{name}={path}" for name, path in adapters.items() if not path.is_dir()]
    if missing:
        raise UsageError(f"--adapter {', '.join(missing)}: no such directory")
    if args.model in adapters:
        raise UsageError(f"--adapter {args.model}: the base model's id cannot name an adapter")
    return gguf_path, adapters


async def _serve(engine: HfEngine, args: argparse.Namespace) -> None:
    server = Server(engine, args.model, args.max_batch)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    bound = await server.start(args.host, args.port)
    print(f"hf_server listening on http://{args.host}:{bound}", flush=True)
    await stopped.wait()
    log.info("stopping")
    await server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        gguf_path, adapters = _resolve(args)
    except UsageError as err:
        print(f"hf_server: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    engine = HfEngine(gguf_path, adapters, DTYPES[args.dtype])
    engine.warm_up()
    log.info(
        "serving %s and %d adapters, batches of up to %d, %d torch threads",
        args.model,
        len(adapters),
        args.max_batch,
        torch.get_num_threads(),
    )
    asyncio.run(_serve(engine, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
