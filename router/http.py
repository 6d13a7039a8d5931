"""OpenAI-compatible HTTP on the router (aiohttp), plus /metrics and /health.

Routes: GET /v1/models and /v1/models/{id}; POST /v1/completions and
/v1/chat/completions, one JSON answer or, with `"stream": true`, server-sent events
(`data: {chunk}` ... `data: [DONE]`);
POST /v1/load_lora_adapter (`{"lora_name", "lora_path"}`) and /v1/unload_lora_adapter
(`{"lora_name"}`), vLLM's adapter endpoints, which register and unregister through the
same catalog as gRPC RegisterAdapter/UnregisterAdapter; GET /metrics (Prometheus text);
GET /health (200 while the router serves and a worker is up, else 503). With an API key
(jlora.contract.auth), the /v1 routes need `Authorization: Bearer <key>` (401 without);
/health and /metrics stay open.

The handlers call the front door in-process, on the router's event loop (no second
gRPC hop): a request body becomes a `jlora.v1` GenerateRequest, its stream the
OpenAI answer. `model` is an adapter's name or the base model's id.

The bodies are `router.openai_protocol`'s models: which fields are honoured, ignored or
refused, and the defaults. /v1/completions takes a batch of prompts (n choices each, run
side by side; a prompt's first choice alone until its first token, then the others on
its worker, whose prefix cache then holds the prompt); `logprobs` (completions: the N
most likely per token; chat: `logprobs` and `top_logprobs`), `echo` and vLLM's
`prompt_logprobs` come back in OpenAI's and vLLM's shapes, the tokens' texts decoded by
the worker. The deadline is the router's
`request_timeout`, or the `X-Request-Timeout` header (seconds) if smaller.
`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens the workers' prefix
caches served (Usage.cached_tokens).

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, mapped
once from the `RequestError` the router or a worker raised (`http_error`): the HTTP
status from its code (400 for bad input, 401 without the API key, 404 for an unknown
model, 409 for a duplicate, 429 when the queue is full, 503 when no worker can take the
request or the router drains, 504 past the deadline, 500 otherwise); `param` from the
field it names, renamed to the request body's (`sampling.top_p` is `top_p`, `adapter`
is `model`, `prompt.chat.messages[0].role` is `messages[0].role`); `code` from its
reason in lower case. A stream that fails after its first chunk ends with one
`data: {"error": ...}` event and no [DONE] (the `openai` client raises APIError). An
exception no handler expected is a 500 in the same shape (`code` "internal_error"),
logged with its traceback.

Limits (`HttpLimits`; `router.http_body` reads and checks the body): a body too large
is 413, one that does not arrive in time 408 (and the connection is closed), one that is
not JSON, too deep or not valid Unicode 400, all before anything is queued; a
connection idle without a whole request head is closed. HTTP/1.1 serves one request at
a time per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from jlora.api import jlora_pb2 as pb
from jlora.contract.auth import authorized, missing_key
from jlora.contract.errors import Code, RequestError
from router.frontdoor import FrontDoor
from router.http_body import HttpError, HttpLimits, answer, app_runner, read_json_body
from router.openai_answers import Answer
from router.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    choices,
    completion_messages,
    parse,
    tool_parsing,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger(__name__)

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
# status code -> (HTTP status, OpenAI error type); anything else is 500, "server_error"
_HTTP_STATUS = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.OUT_OF_RANGE: (400, "invalid_request_error"),
    Code.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Code.UNAUTHENTICATED: (401, "invalid_request_error"),
    Code.NOT_FOUND: (404, "invalid_request_error"),
    Code.ALREADY_EXISTS: (409, "invalid_request_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.CANCELLED: (499, "cancelled"),
    Code.UNIMPLEMENTED: (501, "server_error"),
    Code.UNAVAILABLE: (503, "service_unavailable"),
    Code.DEADLINE_EXCEEDED: (504, "timeout"),
}
# A reason as OpenAI's clients know it, where they know one.
_OPENAI_CODES = {"ADAPTER_NOT_FOUND": "model_not_found"}
# The body fields of vLLM's adapter endpoints, by the jlora.v1 fields they fill.
_LORA_PARAMS = {"name": "lora_name", "path": "lora_path"}


def http_error(err: RequestError, params: Callable[[str], str | None]) -> HttpError:
    """The HTTP error for a RequestError: status by its code, `param` the request body's
    name for its field (`params`), OpenAI's `code` from its reason."""
    status, kind = _HTTP_STATUS.get(err.code, (500, "server_error"))
    param = params(err.field) if err.field else None
    code = _OPENAI_CODES.get(err.reason, err.reason.lower())
    return HttpError(status, err.message, param=param, kind=kind, code=code)


def generate_param(chat: bool, body: dict[str, Any]) -> Callable[[str], str | None]:
    """The (chat) completions body's name for a GenerateRequest field."""

    def param(field: str) -> str | None:
        if field == "adapter":
            return "model"
        if field == "sampling.max_tokens" and chat and "max_completion_tokens" in body:
            return "max_completion_tokens"
        if field == "sampling.logprobs" and chat:
            return "top_logprobs"
        if field == "sampling.structured":
            return "structured_outputs" if "structured_outputs" in body else "response_format"
        if field.startswith("sampling."):
            return field.removeprefix("sampling.")
        if field.startswith("prompt.chat."):
            return field.removeprefix("prompt.chat.")
        if field.startswith("prompt"):
            return "messages" if chat else "prompt"
        return None  # request_id and the like: not in the body

    return param


def lora_param(field: str) -> str | None:
    """vLLM's adapter endpoints' name for a RegisterAdapterRequest field."""
    return _LORA_PARAMS.get(field)


class OpenAIApi:
    """The aiohttp application's handlers, bound to one front door."""

    def __init__(
        self,
        front: FrontDoor,
        *,
        request_timeout: float | None,
        api_key: str | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self._front = front
        self._request_timeout = request_timeout
        self._api_key = api_key
        self.limits = limits or HttpLimits()
        self._started = int(time.time())  # `created` of the models the registry lacks
        self.app = web.Application(
            middlewares=[self._errors], client_max_size=self.limits.max_body_bytes
        )
        self.app.add_routes(
            [
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model:.+}", self.model),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/load_lora_adapter", self.load_lora_adapter),
                web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
                web.get("/metrics", self.metrics),
                web.get("/health", self.health),
            ]
        )

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if request.path.startswith("/v1/") and not authorized(
                request.headers.get("Authorization"), self._api_key
            ):
                raise http_error(missing_key(), lora_param)
            return await handler(request)
        except HttpError as err:
            return await answer(request, err)
        except web.HTTPException as err:  # aiohttp's own 404/405
            error = HttpError(err.status, f"{request.method} {request.path}: {err.reason}")
            return web.json_response(error.body(), status=err.status)
        except ConnectionError:
            raise  # the client went away: nobody to answer
        except Exception:
            if request.writer.output_size > 0:
                raise  # an answer already under way: aiohttp drops the connection
            return web.json_response(_internal_error(request).body(), status=500)

    # -- routes -----------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        created = await self._created()
        data = [self._model(model, created) for model in self._front.models()]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """One model (the `openai` client's `models.retrieve`)."""
        model_id = request.match_info["model"]
        for model in self._front.models():
            if model.id == model_id:
                return web.json_response(self._model(model, await self._created()))
        raise HttpError(
            404,
            f"model={model_id!r} is not served here (see /v1/models)",
            param="model",
            code="model_not_found",
        )

    def _model(self, model: pb.Model, created: dict[str, int]) -> dict[str, Any]:
        return {
            "id": model.id,
            "object": "model",
            "created": created.get(model.id, self._started),
            "owned_by": "jlora",
            "root": model.parent or model.id,
            "parent": model.parent or None,
            "max_model_len": model.max_seq_len,
            "lora_rank": model.rank,
        }

    async def _created(self) -> dict[str, int]:
        """The registered adapters' registration times, in seconds since the epoch."""
        try:
            entries = await asyncio.to_thread(self._front.adapters.registry.list)
        except RequestError as err:
            raise http_error(err, lambda field: None) from None
        return {entry.name: int(entry.created_at) for entry in entries}

    async def metrics(self, request: web.Request) -> web.Response:
        body = await self._front.metrics.exposition()  # the workers' too (router/metrics.py)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        workers = {
            w.address: "up" if w.up else f"down: {w.reason}" for w in self._front.pool.workers
        }
        serving = not self._front.draining and any(w.up for w in self._front.pool.workers)
        status = "ok" if serving else "draining" if self._front.draining else "no worker is up"
        return web.json_response(
            {"status": status, "workers": workers}, status=200 if serving else 503
        )

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's endpoint: register the adapter at `lora_path` as `lora_name`."""
        body = await read_json_body(request, self.limits)
        message = pb.RegisterAdapterRequest(
            name=_typed(body, "lora_name", str, default=""),
            path=_typed(body, "lora_path", str, default=""),
        )
        try:
            await self._front.adapters.register(message)
        except RequestError as err:
            raise http_error(err, lora_param) from None
        return web.Response(text=f"Success: LoRA adapter '{message.name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's endpoint: unregister the adapter `lora_name` (refused while in use)."""
        body = await read_json_body(request, self.limits)
        name = _typed(body, "lora_name", str, default="")
        try:
            await self._front.adapters.unregister(name)
        except RequestError as err:
            raise http_error(err, lora_param) from None
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json_body(request, self.limits)
        parsed = parse(CompletionRequest, body)
        return await self._generate(request, body, parsed, completion_messages(parsed))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json_body(request, self.limits)
        parsed = parse(ChatRequest, body)
        parsing = tool_parsing(parsed, self._front.tool_call_parser())
        return await self._generate(
            request, body, parsed, chat_messages(parsed, parsing), parsing=parsing
        )

    # -- Generate ---------------------------------------------------------------------

    async def _generate(
        self,
        request: web.Request,
        body: dict[str, Any],
        parsed: CompletionRequest | ChatRequest,
        messages: list[pb.GenerateRequest],
        *,
        parsing: tuple[str, str] | None = None,
    ) -> web.StreamResponse:
        """Each message's stream, side by side: one choice each (`choices`' best_of per
        prompt, the n most likely of them returned). A prompt's first choice runs
        alone until its first token; its siblings then go to the same worker, whose
        prefix cache holds the prompt by then (one prefill shared). `parsing`: how a
        chat answer's text becomes tool calls (`tool_parsing`)."""
        chat = isinstance(parsed, ChatRequest)
        include_usage = parsed.stream_options is not None and parsed.stream_options.include_usage
        deadline = self._deadline(request)
        request_id = uuid.uuid4().hex
        for i, message in enumerate(messages):
            message.request_id = request_id if len(messages) == 1 else f"{request_id}-{i}"
        n, best_of = choices(parsed)
        groups = [f"{request_id}/{start}" for start in range(0, len(messages), best_of)]
        params = generate_param(chat, body)
        streams = [
            self._front.generate(message, deadline=deadline, group=groups[i // best_of])
            for i, message in enumerate(messages)
        ]
        async with contextlib.AsyncExitStack() as closing:
            for group in groups:
                closing.callback(self._front.release_group, group)
            for stream in streams:
                await closing.enter_async_context(contextlib.aclosing(stream))
            try:  # errors before any token are plain HTTP errors
                leaders = await asyncio.gather(*(anext(s) for s in streams[::best_of]))
                others = [s for i, s in enumerate(streams) if i % best_of]
                rest = iter(await asyncio.gather(*(anext(s) for s in others)))
            except RequestError as err:
                raise http_error(err, params) from None
            firsts = [leaders[i // best_of] if i % best_of == 0 else next(rest)
                      for i in range(len(streams))]  # fmt: skip
            shape = Answer(parsed, messages, request_id=request_id, per_prompt=n, parsing=parsing)
            if not parsed.stream:
                try:
                    rests = await asyncio.gather(*(_rest(stream) for stream in streams))
                except RequestError as err:
                    raise http_error(err, params) from None
                answers = [[first, *rest] for first, rest in zip(firsts, rests, strict=True)]
                return web.json_response(shape.whole(answers, best_of=best_of))
            sse = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await sse.prepare(request)
            lasts = list(firsts)
            try:
                for index, first in enumerate(firsts):
                    for chunk in shape.opening(index, first, usage=include_usage):
                        await _event(sse, chunk)
                async for index, response in _merged(streams):
                    await _event(sse, shape.chunk(index, response, usage=include_usage))
                    lasts[index] = response
            except RequestError as err:
                await _event(sse, http_error(err, params).body())
                return sse
            except Exception as err:
                if isinstance(err, ConnectionError):
                    raise
                await _event(sse, _internal_error(request).body())
                return sse
            if include_usage:
                await _event(sse, shape.usage_chunk(lasts))
            await sse.write(b"data: [DONE]\n\n")
            await sse.write_eof()
            return sse

    def _deadline(self, request: web.Request) -> float | None:
        timeouts = [self._request_timeout] if self._request_timeout is not None else []
        header = request.headers.get("X-Request-Timeout")
        if header is not None:
            try:
                seconds = float(header)
            except ValueError:
                seconds = math.nan
            if not (math.isfinite(seconds) and seconds > 0):
                raise HttpError(
                    400, f"X-Request-Timeout={header!r} must be a positive number of seconds"
                )
            timeouts.append(seconds)
        if not timeouts:
            return None
        return asyncio.get_running_loop().time() + min(timeouts)


def _internal_error(request: web.Request) -> HttpError:
    """The answer to an exception no handler expected (logged here, with its traceback)."""
    log.exception("%s %s failed", request.method, request.path)
    return HttpError(
        500,
        f"{request.method} {request.path}: the router failed on this request (its log has "
        "the traceback)",
        kind="server_error",
        code="internal_error",
    )


async def _rest(stream: AsyncIterator[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    return [response async for response in stream]


async def _merged(
    streams: Sequence[AsyncIterator[pb.GenerateResponse]],
) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """(index, response) of every stream, as they come; a stream's error is raised."""
    if len(streams) == 1:
        async for response in streams[0]:
            yield 0, response
        return
    queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[pb.GenerateResponse]) -> None:
        try:
            async for response in stream:
                await queue.put((index, response))
        except BaseException as err:  # noqa: BLE001 (re-raised by the reader)
            await queue.put((index, err))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _event(sse: web.StreamResponse, data: dict[str, Any]) -> None:
    await sse.write(f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode())


def _typed(body: dict[str, Any], field: str, kind: type, *, default: Any, prefix: str = "") -> Any:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise HttpError(
            400, f"{prefix}{field}={value!r} must be a {kind.__name__}", param=prefix + field
        )
    return value


async def start_http(api: OpenAIApi, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `api` on host:port (0: a free port); the runner and the bound port.

    A client that disconnects cancels its handler (and so its worker call); a connection
    without a whole request head for `api.limits.idle_timeout` seconds is closed."""
    runner = app_runner(
        api.app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=api.limits.idle_timeout,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    return runner, bound
