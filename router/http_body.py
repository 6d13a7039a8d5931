"""A request body on the router's HTTP API: read within limits, parsed, checked.

What one client may hold (`HttpLimits`), each hit answered in OpenAI's error shape
(`HttpError`) before anything is queued:

1. The headers have arrived (aiohttp closes a connection that has no whole request
   head `idle_timeout` seconds after it opened or after its last answer: idle
   keep-alive, or headers that never end).
2. A Content-Length over `max_body_bytes` is 413 at once; a body that grows past it
   while it is read, too.
3. The body must arrive whole within `body_timeout` seconds, else 408 and the
   connection is closed as soon as the answer is sent (`answer`), instead of lingering
   to read a body that is not coming: a client that sends headers only, or less than
   its Content-Length, holds nothing for longer.
4. It must be a JSON object (400 otherwise, `code` "invalid_json"), parsed off the event
   loop when large; nested at most `MAX_JSON_DEPTH` deep (json's own recursion limit,
   which 50,000 levels of `[` hit, is the same 400); and, where the text escapes a
   surrogate (`\\ud800`), every string must be valid Unicode: a lone surrogate, which
   UTF-8 cannot encode, is 400 (`code` "invalid_unicode") naming the field, such as
   `prompt` or `messages[0].content`.

A request aiohttp cannot parse at all (a bad request line, a bad chunk size, both
Content-Length and Transfer-Encoding) never reaches a handler: `app_runner` answers it in
the same error shape (400, `code` "malformed_request"), where a response can still be
written, closes the connection, and logs one WARNING line without a traceback, so a
client cannot flood the log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
from typing import Any

from aiohttp import web, web_protocol

from jlora.contract.grpc_server import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 64  # nesting of a request body; OpenAI's bodies need about 6
_THREAD_PARSE_BYTES = 2**20  # bodies larger than this are parsed off the event loop
# A JSON escape of a UTF-16 surrogate: only through one can a string hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


# The largest body HttpLimits takes: what a forwarded request may hold, with room for the
# proto's own fields beside the prompt.
MAX_BODY_BYTES = MAX_MESSAGE_BYTES - (8 << 20)


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What one HTTP client may hold of the router (see the module docstring).

    max_body_bytes: a request body's size (413 past it). body_timeout: seconds for a
    body to arrive once its headers have (408 past it, and the connection is closed).
    idle_timeout: seconds a connection may stay open without a whole request head, idle
    between requests or with its headers unfinished (closed past it).
    """

    max_body_bytes: int = 32 * 2**20
    body_timeout: float = 10.0
    idle_timeout: float = 30.0

    def __post_init__(self) -> None:
        for field in ("max_body_bytes", "body_timeout", "idle_timeout"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{field}={value!r} must be a positive number")
        if self.max_body_bytes > MAX_BODY_BYTES:
            raise ValueError(
                f"max_body_bytes={self.max_body_bytes} must be at most {MAX_BODY_BYTES} "
                f"({MAX_BODY_BYTES / 2**20:g} MiB: a request forwarded to a worker must fit "
                "a gRPC message)"
            )


class HttpError(Exception):
    """An OpenAI error answer; `close`: close the connection once it is sent."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code, self.close = code, close

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


async def answer(request: web.Request, err: HttpError) -> web.Response:
    """`err` as the response; with `err.close`, sent here and the connection closed at
    once, rather than kept open to read (linger over) a body that is not coming."""
    response = web.json_response(err.body(), status=err.status)
    if err.close:
        response.force_close()
        await response.prepare(request)
        await response.write_eof()
        request.protocol.force_close()
    return response


async def read_json_body(request: web.Request, limits: HttpLimits) -> dict[str, Any]:
    """The request body, read within `limits`, as a checked JSON object."""
    raw = await _read_body(request, limits)
    if len(raw) > _THREAD_PARSE_BYTES:
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


async def _read_body(request: web.Request, limits: HttpLimits) -> bytes:
    """The whole body: 413 past `limits.max_body_bytes`; 408 (the connection closed)
    if it has not all arrived within `limits.body_timeout`."""
    declared = request.content_length
    if declared is not None and declared > limits.max_body_bytes:
        raise _too_large(f"Content-Length: {declared}", limits)
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limits.max_body_bytes:
                    raise _too_large(f"more than {limits.max_body_bytes} bytes", limits)
    except TimeoutError:
        of = f" of the {declared} announced" if declared is not None else ""
        raise HttpError(
            408,
            f"the request body did not arrive within {limits.body_timeout:g} s ({len(body)} "
            f"bytes{of}); the connection is closed",
            code="request_timeout",
            close=True,
        ) from None
    return bytes(body)


def _too_large(size: str, limits: HttpLimits) -> HttpError:
    return HttpError(
        413,
        f"the request body ({size}) is larger than the limit of {limits.max_body_bytes} bytes",
        code="request_too_large",
    )


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The JSON object `raw` holds; 400 for one that is not JSON, not an object, nested
    deeper than MAX_JSON_DEPTH or holding a string that is not valid Unicode."""
    try:
        body = json.loads(raw)
    except RecursionError:  # json's own recursion, far past MAX_JSON_DEPTH
        raise _too_deep(None) from None
    except UnicodeDecodeError as err:
        raise HttpError(
            400, f"the request body is not valid JSON: not UTF-8 text ({err})", code="invalid_json"
        ) from None
    except ValueError as err:  # JSONDecodeError, an integer too long to convert
        raise HttpError(
            400, f"the request body is not valid JSON ({err})", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise HttpError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    _check_json(body, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _check_json(body: dict[str, Any], *, strings: bool) -> None:
    """No value of `body` nests deeper than MAX_JSON_DEPTH; with `strings` (the JSON text
    escapes a surrogate), every key and string is valid Unicode. Iterative: a list of
    scalars, such as token ids, is skipped whole."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, where, param=where)
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(re.split(r"[.\[]", where, maxsplit=1)[0])
        if isinstance(value, dict):
            if strings:
                for key in value:
                    _check_unicode(key, f"a key of {where or 'the body'}", param=where or None)
            children = [(item, f"{where}.{key}" if where else key) for key, item in value.items()]
        else:
            kinds = set(map(type, value))
            if not ({dict, list} & kinds or (strings and str in kinds)):
                continue
            children = [(item, f"{where}[{i}]") for i, item in enumerate(value)]
        stack.extend(
            (item, path, depth + 1)
            for item, path in children
            if isinstance(item, dict | list) or (strings and isinstance(item, str))
        )


def _check_unicode(text: str, where: str, *, param: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise HttpError(
            400,
            f"{where} is not valid Unicode: it holds a lone surrogate "
            f"(U+{ord(text[err.start]):04X} at index {err.start}; a JSON \\u escape of "
            "half a surrogate pair)",
            param=param,
            code="invalid_unicode",
        ) from None


def _too_deep(field: str | None) -> HttpError:
    where = f" (in {field})" if field else ""
    return HttpError(
        400,
        f"the request body nests deeper than {MAX_JSON_DEPTH} levels{where}",
        param=field,
        code="invalid_json",
    )


def app_runner(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """`web.AppRunner(app, **kwargs)` whose connections answer malformed requests in
    OpenAI's error shape (see the module docstring)."""
    return _Runner(app, **kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server; its connections' handler is ours
        return server


class _Server(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


class _RequestHandler(web_protocol.RequestHandler):
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request the parser refused (400): the JSON error shape and one WARNING
        line; anything else as aiohttp answers it."""
        if status != 400:
            return super().handle_error(request, status, exc, message)
        # The parser's message may quote the bad bytes over several lines: its first.
        reason = str(getattr(exc, "message", None) or message or type(exc).__name__)
        reason = reason.strip().splitlines()[0].rstrip(":")
        log.warning("malformed HTTP request from %s: %s", request.remote, reason)
        error = HttpError(
            400, f"the request cannot be parsed: {reason}", code="malformed_request", close=True
        )
        response = web.json_response(error.body(), status=400)
        response.force_close()
        return response
