"""The open-loop serving harness: replay a workload against a running server, measure.

`run(workload, "http://127.0.0.1:8000")` (any OpenAI-compatible server: jlora's router,
vLLM, ...) or `run(workload, "grpc://127.0.0.1:50050")` (jlora.v1, a router or a worker)
returns one `RequestRecord` per request, `summarize(records)` the table row and
`format_summary` its text; `python -m bench.serve` is the same from the command line.

A replay, step by step:

1. The client connects (HTTP: an aiohttp session with no connection limit, since an
   HTTP/1.1 server serves one request per connection; gRPC: channels of at most
   `STREAMS_PER_CHANNEL` streams each, below the servers' cap of concurrent streams
   per connection, so no request waits in the client for a free stream). For HTTP the
   base model's id comes from GET /v1/models (the entry without a `parent`, else the
   first) unless given.
2. One dispatcher coroutine walks the requests in arrival order, sleeps until
   t0 + arrival_s and starts the request as its own task. It never waits for a reply:
   the load is open-loop, as users' is, and a slow server builds a queue instead of
   slowing the arrivals. Each record keeps the scheduled and the actual send offset,
   so a client that fell behind its schedule shows.
3. Every request asks for greedy decoding with ignore_eos, so it generates exactly
   max_tokens tokens, and streams: HTTP POST /v1/completions with `"stream": true` and
   `stream_options.include_usage` (server-sent events until `data: [DONE]`), gRPC
   `Generate` (one message per token, the last with the usage). The time to first
   token (TTFT) ends at the first event that carries a token: an SSE chunk with a
   choice, or a gRPC message (its text may be empty while a multi-byte character is
   pending). The token count is the server's usage.completion_tokens, else the number
   of token events. TPOT = (e2e - TTFT) / (tokens - 1).
4. A request that fails (an HTTP status other than 200, an error event in the stream,
   a gRPC status, a refused connection, no reply within `timeout_s`) keeps its error
   as a short string (`HTTP 404: ...`, `NOT_FOUND: ...`, `timeout after 600 s`) and
   counts in the summary; the replay goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import sys
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import grpc
import numpy as np
from tqdm import tqdm

from bench.lib.workloads import WordTokenizer, Workload, WorkloadRequest
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.contract.auth import call_metadata

DEFAULT_TIMEOUT_S = 600.0
STREAMS_PER_CHANNEL = 100  # jlora's servers allow 128 concurrent streams per connection
_ERROR_CHARS = 300  # an error message is cut to this


@dataclasses.dataclass
class RequestRecord:
    """What happened to one request. Offsets (`*_s`) are seconds since the replay
    started; latencies (`*_ms`) milliseconds, None unless the request completed (TTFT is
    kept for a stream that failed after its first token)."""

    id: str
    adapter: str | None
    scheduled_s: float
    sent_s: float | None = None
    finished_s: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None  # None for a single token
    e2e_ms: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them
    error: str | None = None
    text: str = ""


class RequestFailed(Exception):
    """One request failed; the message is what its record keeps."""


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """One event of a stream: a token (text, possibly empty) and/or the final usage."""

    text: str | None  # None: no token in this event
    completion_tokens: int | None = None
    prompt_tokens: int | None = None


class StreamClient(Protocol):
    """A front door: `stream` yields one request's events, raising RequestFailed."""

    async def start(self) -> None: ...

    def stream(self, request: WorkloadRequest) -> AsyncIterator[StreamEvent]: ...

    async def close(self) -> None: ...


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= _ERROR_CHARS else message[: _ERROR_CHARS - 3] + "..."


# -- OpenAI-compatible HTTP --------------------------------------------------------------


class OpenAIClient:
    """Streams POST /v1/completions; `url` is the server's root (a trailing /v1 is fine)."""

    def __init__(self, url: str, *, base_model: str | None, api_key: str | None) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.base_model = base_model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # a connection per request in flight
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=None),  # the harness's own timeout governs
        )
        if self.base_model is None:
            self.base_model = await self._base_model()

    async def _base_model(self) -> str:
        assert self._session is not None
        where = f"GET {self.url}/v1/models"
        try:
            async with self._session.get(f"{self.url}/v1/models") as reply:
                if reply.status != 200:
                    raise RequestFailed(f"{where}: {await _http_error(reply)}")
                models = (await reply.json()).get("data") or []
        except (aiohttp.ClientError, OSError, json.JSONDecodeError) as err:
            raise RequestFailed(f"{where}: {err}") from None
        if not models:
            raise RequestFailed(f"{where}: no models listed (give the base model's id)")
        base = next((model for model in models if not model.get("parent")), models[0])
        return str(base["id"])

    async def stream(self, request: WorkloadRequest) -> AsyncIterator[StreamEvent]:
        assert self._session is not None
        body = {
            "model": request.adapter or self.base_model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        try:
            async with self._session.post(f"{self.url}/v1/completions", json=body) as reply:
                if reply.status != 200:
                    raise RequestFailed(await _http_error(reply))
                async for line in reply.content:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, other SSE fields
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    yield _chunk_event(json.loads(data))
        except (aiohttp.ClientError, OSError) as err:
            raise RequestFailed(_short(f"connection: {type(err).__name__}: {err}")) from None
        except json.JSONDecodeError as err:
            raise RequestFailed(f"a stream chunk is not JSON ({err.msg})") from None
        raise RequestFailed("the stream ended without data: [DONE]")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _chunk_event(chunk: dict[str, Any]) -> StreamEvent:
    if "error" in chunk:  # a stream that failed after its first chunk
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise RequestFailed(_short(f"stream error: {message}"))
    choices = chunk.get("choices") or []
    usage = chunk.get("usage") or {}
    return StreamEvent(
        text=(choices[0].get("text") or "") if choices else None,
        completion_tokens=usage.get("completion_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
    )


async def _http_error(reply: aiohttp.ClientResponse) -> str:
    """`HTTP <status>: <message>`, the message from OpenAI's error shape if it is one."""
    text = await reply.text()
    try:
        error = json.loads(text).get("error")
        message = error.get("message", text) if isinstance(error, dict) else error or text
    except (json.JSONDecodeError, AttributeError):
        message = text
    return _short(f"HTTP {reply.status}: {message}")


# -- jlora.v1 gRPC -----------------------------------------------------------------------


class JloraGrpcClient:
    """Streams jlora.v1 Generate; the base model is the empty adapter unless named."""

    def __init__(
        self, address: str, *, base_model: str | None, api_key: str | None, word_ids: bool = False
    ) -> None:
        self.address = address
        self.base_model = base_model or ""
        self._words = WordTokenizer() if word_ids else None
        self._metadata = call_metadata(api_key)
        self._channels: list[grpc.aio.Channel] = []
        self._in_flight: list[int] = []

    async def start(self) -> None:
        """Channels open on first use."""

    def _acquire(self) -> int:
        """A channel with room for one more stream (a new one, with its own connection,
        if every open one is full)."""
        open_ = enumerate(self._in_flight)
        index = next((i for i, count in open_ if count < STREAMS_PER_CHANNEL), None)
        if index is None:
            options = [("grpc.use_local_subchannel_pool", 1)]  # its own TCP connection
            self._channels.append(grpc.aio.insecure_channel(self.address, options=options))
            self._in_flight.append(0)
            index = len(self._channels) - 1
        self._in_flight[index] += 1
        return index

    async def stream(self, request: WorkloadRequest) -> AsyncIterator[StreamEvent]:
        message = pb.GenerateRequest(adapter=request.adapter or self.base_model)
        if self._words is not None:
            message.token_ids.ids.extend(self._words.encode(request.prompt))
        else:
            message.text = request.prompt
        message.sampling.max_tokens = request.max_tokens
        message.sampling.temperature = 0
        message.sampling.ignore_eos = True
        index = self._acquire()
        try:
            stub = pb_grpc.JloraStub(self._channels[index])
            async for response in stub.Generate(message, metadata=self._metadata):
                last = response.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield StreamEvent(
                    text=response.text,
                    completion_tokens=response.usage.completion_tokens if last else None,
                    prompt_tokens=response.usage.prompt_tokens if last else None,
                )
        except grpc.aio.AioRpcError as err:
            raise RequestFailed(_short(f"{err.code().name}: {err.details()}")) from None
        finally:
            self._in_flight[index] -= 1

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def make_client(
    target: str, *, base_model: str | None, api_key: str | None, word_ids: bool = False
) -> StreamClient:
    """The client for `target`: http(s)://host:port or grpc://host:port. word_ids (gRPC
    only): send each prompt as token ids, `WordTokenizer`'s encoding of its words, for
    a model without a tokenizer (a random-weight preset)."""
    parts = urlsplit(target)
    if parts.scheme in ("http", "https") and parts.netloc:
        if word_ids:
            raise ValueError(f"target={target!r}: word_ids needs a grpc:// target")
        return OpenAIClient(target, base_model=base_model, api_key=api_key)
    if parts.scheme == "grpc" and parts.netloc:
        return JloraGrpcClient(
            parts.netloc, base_model=base_model, api_key=api_key, word_ids=word_ids
        )
    raise ValueError(f"target={target!r} must be http://host:port or grpc://host:port")


# -- the replay --------------------------------------------------------------------------


async def replay(
    workload: Workload,
    target: str,
    *,
    base_model: str | None = None,
    api_key: str | None = None,
    progress: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    word_ids: bool = False,
) -> list[RequestRecord]:
    """Send every request at its arrival time (open loop); one record per request, in
    the workload's order. RequestFailed if the client cannot start (HTTP: /v1/models)."""
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    client = make_client(target, base_model=base_model, api_key=api_key, word_ids=word_ids)
    records = [RequestRecord(r.id, r.adapter, r.arrival_s) for r in workload.requests]
    bar = tqdm(total=len(records), disable=not progress, unit="req", desc=target, file=sys.stderr)
    tasks: list[asyncio.Task] = []
    try:
        await client.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        order = sorted(zip(workload.requests, records, strict=True), key=lambda p: p[0].arrival_s)
        for request, record in order:
            delay = t0 + request.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(client, request, record, t0, timeout_s)))
            tasks[-1].add_done_callback(lambda _: bar.update(1))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # only if the replay itself failed or was cancelled
            task.cancel()
        bar.close()
        await client.close()
    return records


async def _send(
    client: StreamClient,
    request: WorkloadRequest,
    record: RequestRecord,
    t0: float,
    timeout_s: float,
) -> None:
    loop = asyncio.get_running_loop()
    sent = loop.time()
    record.sent_s = sent - t0
    first: float | None = None
    texts: list[str] = []
    token_events = 0
    usage_tokens: int | None = None
    try:
        async with (
            asyncio.timeout(timeout_s),
            contextlib.aclosing(client.stream(request)) as events,
        ):
            async for event in events:
                if event.text is not None:
                    first = loop.time() if first is None else first
                    token_events += 1
                    texts.append(event.text)
                if event.completion_tokens is not None:
                    usage_tokens = event.completion_tokens
                if event.prompt_tokens is not None:
                    record.prompt_tokens = event.prompt_tokens
    except TimeoutError:
        record.error = f"timeout after {timeout_s:g} s"
    except RequestFailed as err:
        record.error = str(err)
    end = loop.time()
    record.finished_s = end - t0
    record.text = "".join(texts)
    record.output_tokens = usage_tokens if usage_tokens is not None else token_events
    if first is not None:
        record.ttft_ms = 1e3 * (first - sent)
    if record.error is None and first is None:
        record.error = "the stream carried no token"
    if record.error is None:
        record.e2e_ms = 1e3 * (end - sent)
        if record.output_tokens > 1:
            record.tpot_ms = (end - first) * 1e3 / (record.output_tokens - 1)


def run(
    workload: Workload,
    target: str,
    *,
    base_model: str | None = None,
    api_key: str | None = None,
    progress: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    word_ids: bool = False,
) -> list[RequestRecord]:
    """`replay` from synchronous code (starts and ends its own event loop)."""
    return asyncio.run(
        replay(
            workload,
            target,
            base_model=base_model,
            api_key=api_key,
            progress=progress,
            timeout_s=timeout_s,
            word_ids=word_ids,
        )
    )


# -- results -----------------------------------------------------------------------------


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(np.mean(values)), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(records: Sequence[RequestRecord], *, duration_s: float | None = None) -> dict:
    """Counts, throughput and latency percentiles (ms) of the completed requests.

    Throughput is over `duration_s`, by default the makespan: from the first send to the
    last finish of a completed request. `errors_by_kind` counts errors by their prefix
    (`HTTP 404`, `NOT_FOUND`, `timeout after 600 s`); `send_lag_ms` is how late the
    requests left against their schedule (the client's own delay, not the server's).
    """
    completed = [r for r in records if r.error is None]
    if duration_s is None:
        sent = [r.sent_s for r in records if r.sent_s is not None]
        finished = [r.finished_s for r in completed if r.finished_s is not None]
        duration_s = max(finished) - min(sent) if finished else 0.0
    tokens = sum(r.output_tokens for r in completed)
    lags = [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]
    errors = Counter(r.error.split(":")[0] for r in records if r.error is not None)
    return {
        "requests": len(records),
        "completed": len(completed),
        "errors": len(records) - len(completed),
        "errors_by_kind": dict(errors.most_common()),
        "duration_s": duration_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration_s if duration_s > 0 else None,
        "requests_per_s": len(completed) / duration_s if duration_s > 0 else None,
        "ttft_ms": _stats([r.ttft_ms for r in completed if r.ttft_ms is not None]),
        "tpot_ms": _stats([r.tpot_ms for r in completed if r.tpot_ms is not None]),
        "e2e_ms": _stats([r.e2e_ms for r in completed if r.e2e_ms is not None]),
        "send_lag_ms": {
            "p99": float(np.percentile(lags, 99)) * 1e3 if lags else None,
            "max": max(lags) * 1e3 if lags else None,
        },
    }


def format_summary(summary: dict, *, label: str) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:9.1f}"

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    kinds = summary["errors_by_kind"]
    errors = f"{summary['errors']} errors" + (f" {kinds}" if kinds else "")
    lines = [
        f"{label}: {summary['requests']} requests, {summary['completed']} completed, {errors} "
        f"in {summary['duration_s']:.1f} s",
        f"throughput: {rate(summary['output_tokens_per_s'])} output tokens/s, "
        f"{rate(summary['requests_per_s'])} requests/s",
        f"{'':8}{'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}",
    ]
    for key, name in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("e2e_ms", "E2E ms")):
        stats = summary[key]
        lines.append(f"{name:8}" + " ".join(cell(stats[q]) for q in ("mean", "p50", "p90", "p99")))
    lag = summary["send_lag_ms"]
    lines.append(f"send lag ms: p99 {cell(lag['p99']).strip()}, max {cell(lag['max']).strip()}")
    return "\n".join(lines)
