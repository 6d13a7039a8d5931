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

Semantics beside OpenAI's: one prompt and one choice per request (`n`, `best_of` > 1 and
batched prompts are refused); unset sampling fields take jlora's defaults (greedy,
`temperature` 0), except that /v1/completions' `max_tokens` defaults to 16 as OpenAI's
does; `top_k` and `ignore_eos` are accepted as extensions; logprobs, echo, penalties,
logit bias, tools and non-text content are refused, naming the field. The deadline is
the router's `request_timeout`, or the `X-Request-Timeout` header (seconds) if smaller.
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
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jlora.api import jlora_pb2 as pb
from jlora.contract.auth import authorized, missing_key
from jlora.contract.errors import Code, RequestError
from router.frontdoor import FrontDoor
from router.http_body import HttpError, HttpLimits, answer, app_runner, read_json_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
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
# Fields OpenAI defines that jlora does not implement: accepted only at these values.
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


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
        body = generate_latest(self._front.metrics.registry)
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
        message = _base_request(body, chat=False)
        _prompt(body, message)
        return await self._generate(request, body, message, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json_body(request, self.limits)
        message = _base_request(body, chat=True)
        _messages(body, message)
        return await self._generate(request, body, message, chat=True)

    # -- Generate ---------------------------------------------------------------------

    async def _generate(
        self, request: web.Request, body: dict[str, Any], message: pb.GenerateRequest, *, chat: bool
    ) -> web.StreamResponse:
        stream_flag = _typed(body, "stream", bool, default=False)
        options = _typed(body, "stream_options", dict, default=None) or {}
        include_usage = _typed(
            options, "include_usage", bool, default=False, prefix="stream_options."
        )
        deadline = self._deadline(request)
        message.request_id = uuid.uuid4().hex
        shape = _Shape(chat=chat, model=body["model"], request_id=message.request_id)
        stream = self._front.generate(message, deadline=deadline)
        params = generate_param(chat, body)
        async with contextlib.aclosing(stream):
            try:
                first = await anext(stream)  # errors before any token are plain HTTP errors
            except RequestError as err:
                raise http_error(err, params) from None
            if not stream_flag:
                responses = [first]
                try:
                    responses += [response async for response in stream]
                except RequestError as err:
                    raise http_error(err, params) from None
                return web.json_response(shape.whole(responses))
            sse = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await sse.prepare(request)
            if chat:
                await _event(sse, shape.chunk(role=True, usage=include_usage))
            await _event(sse, shape.chunk(first, usage=include_usage))
            last = first
            try:
                async for response in stream:
                    await _event(sse, shape.chunk(response, usage=include_usage))
                    last = response
            except RequestError as err:
                await _event(sse, http_error(err, params).body())
                return sse
            except Exception as err:
                if isinstance(err, ConnectionError):
                    raise
                await _event(sse, _internal_error(request).body())
                return sse
            if include_usage:
                await _event(sse, shape.usage_chunk(last))
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


class _Shape:
    """OpenAI's objects for one request: whole answers, stream chunks, usage."""

    def __init__(self, *, chat: bool, model: str, request_id: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def whole(self, responses: list[pb.GenerateResponse]) -> dict[str, Any]:
        text = "".join(response.text for response in responses)
        last = responses[-1]
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": _finish(last)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        answer = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        answer["usage"] = _usage(last)
        return answer

    def chunk(
        self, response: pb.GenerateResponse | None = None, *, role: bool = False, usage: bool
    ) -> dict[str, Any]:
        text = response.text if response is not None else ""
        finish = _finish(response) if response is not None else None
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else {"content": text}
        else:
            choice["text"] = text
        chunk = self._envelope(
            "chat.completion.chunk" if self.chat else "text_completion", [choice]
        )
        if usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, last: pb.GenerateResponse) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        chunk["usage"] = _usage(last)
        return chunk


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


def _finish(response: pb.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(response.finish_reason)


def _usage(last: pb.GenerateResponse) -> dict[str, Any]:
    """OpenAI's usage object from the last message's, the prefix-cache hits as
    prompt_tokens_details.cached_tokens."""
    prompt, completion = last.usage.prompt_tokens, last.usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": last.usage.cached_tokens},
    }


async def _event(sse: web.StreamResponse, data: dict[str, Any]) -> None:
    await sse.write(f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode())


# -- request bodies --------------------------------------------------------------------


def _base_request(body: dict[str, Any], *, chat: bool) -> pb.GenerateRequest:
    """The adapter and sampling fields; the prompt is the caller's."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise HttpError(400, f"model={model!r} must be a model id (see /v1/models)", param="model")
    for field, accepted in _UNSUPPORTED.items():
        if body.get(field) not in accepted:
            raise HttpError(
                400,
                f"{field}={body[field]!r} is not supported (accepted: "
                f"{', '.join(repr(value) for value in accepted)})",
                param=field,
            )
    message = pb.GenerateRequest(adapter=model)
    sampling = message.sampling
    max_field = (
        "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    )
    max_tokens = _integer(body, max_field, low=-INT32_MAX, high=INT32_MAX)
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_MAX_TOKENS
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    for field in ("temperature", "top_p"):
        value = body.get(field)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise HttpError(400, f"{field}={value!r} must be a number", param=field)
            setattr(sampling, field, value)
    top_k = _integer(body, "top_k", low=-INT32_MAX, high=INT32_MAX)
    if top_k is not None:
        sampling.top_k = top_k
    seed = _integer(body, "seed", low=0, high=2**64 - 1)
    if seed is not None:
        sampling.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise HttpError(
                400, f"stop={stop!r} must be a string or a list of strings", param="stop"
            )
        sampling.stop.extend(stop)
    sampling.ignore_eos = _typed(body, "ignore_eos", bool, default=False)
    return message


def _prompt(body: dict[str, Any], message: pb.GenerateRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        message.text = prompt
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and -INT32_MAX <= t <= INT32_MAX
        for t in prompt
    ):
        message.token_ids.SetInParent()
        message.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise HttpError(
            400,
            f"prompt: a batch of {len(prompt)} prompts; send one prompt per request",
            param="prompt",
        )
    else:
        raise HttpError(
            400, f"prompt={prompt!r} must be a string or a list of token ids", param="prompt"
        )


def _messages(body: dict[str, Any], message: pb.GenerateRequest) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise HttpError(400, f"messages={messages!r} must be a list of messages", param="messages")
    message.chat.SetInParent()
    for i, item in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise HttpError(400, f"{where}={item!r} must be an object", param=where)
        role = item.get("role")
        if not isinstance(role, str):
            raise HttpError(400, f"{where}.role={role!r} must be a string", param=f"{where}.role")
        content = item.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            content = "".join(
                _text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)
            )
        if not isinstance(content, str):
            raise HttpError(
                400,
                f"{where}.content={content!r} must be a string or text parts",
                param=f"{where}.content",
            )
        message.chat.messages.add(role="system" if role == "developer" else role, content=content)


def _text_part(part: object, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise HttpError(400, f"{where}={part!r}: only text parts are supported", param=where)


def _integer(body: dict[str, Any], field: str, *, low: int, high: int) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"{field}={value!r} must be an integer", param=field)
    if not low <= value <= high:
        raise HttpError(400, f"{field}={value} is out of range [{low}, {high}]", param=field)
    return value


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
