"""Between the wire (`jlora.v1` messages) and the engine's types.

`to_request` validates everything it can without the engine and raises `InvalidRequest`
naming the field (the orchestrator checks the rest: the adapter, the prompt against the
context and the vocabulary). Unset optional sampling fields take the `SamplingParams`
defaults; explicit ones are validated as given. Fields are named by their path in the
jlora.v1 message ("sampling.top_p", "prompt.chat.messages[0].role").
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from jlora.api import jlora_pb2 as pb
from jlora.contract.errors import InvalidRequest
from jlora.contract.tool_calls import bad_name
from jlora.engine.api import (
    DEVICE,
    HOST,
    LOADING,
    AdapterInfo,
    CacheStats,
    EngineStats,
    Logprobs,
    Request,
    RunningInfo,
    SamplingParams,
    StructuredOutput,
)

MAX_REQUEST_ID = 128
CHAT_ROLES = ("system", "user", "assistant", "tool")

FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
ADAPTER_STATES = {
    HOST: pb.ADAPTER_STATE_HOST,
    LOADING: pb.ADAPTER_STATE_LOADING,
    DEVICE: pb.ADAPTER_STATE_DEVICE,
}


class TextCodec(Protocol):
    """What text and chat prompts, and tokens' texts, need (`jlora.tokenizer.Tokenizer`
    is one)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    # whether the chat template shows the tools it is given
    renders_tools: bool

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str: ...


def to_request(
    msg: pb.GenerateRequest,
    *,
    request_id: str,
    tokenizer: TextCodec | None,
    max_seq_len: int,
    base_model: str,
    arrival_time: float,
    defaults: SamplingParams,
) -> Request:
    if len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
        raise InvalidRequest(
            f"request_id={request_id[: MAX_REQUEST_ID + 1]!r} must be at most {MAX_REQUEST_ID} "
            "printable characters",
            field="request_id",
        )
    sampling = to_sampling(msg.sampling, max_seq_len=max_seq_len, defaults=defaults)
    adapter = msg.adapter or None
    if adapter == base_model:
        adapter = None
    return Request(
        request_id,
        _prompt_ids(msg, tokenizer),
        sampling,
        adapter=adapter,
        arrival_time=arrival_time,
    )


def _prompt_ids(msg: pb.GenerateRequest, tokenizer: TextCodec | None) -> list[int]:
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest(
            "prompt is empty: set prompt.text, prompt.token_ids or prompt.chat", field="prompt"
        )
    if kind == "token_ids":
        ids = list(msg.token_ids.ids)
    elif tokenizer is None:
        raise InvalidRequest(
            f"prompt.{kind} needs a tokenizer and this model has none; send prompt.token_ids",
            field="prompt",
        )
    elif kind == "text":
        ids = tokenizer.encode(msg.text) if msg.text else []
    else:
        ids = _chat_ids(msg.chat, tokenizer)
    if not ids:
        raise InvalidRequest(f"prompt is empty (prompt.{kind})", field="prompt")
    return ids


def _chat_ids(chat: pb.ChatMessages, tokenizer: TextCodec) -> list[int]:
    """A chat's messages and tools rendered with the template, then encoded."""
    messages = [_chat_message(message, i) for i, message in enumerate(chat.messages)]
    if not messages:
        raise InvalidRequest("prompt is empty: prompt.chat.messages has no message", field="prompt")
    tools = [_tool(tool, f"prompt.chat.tools[{i}]") for i, tool in enumerate(chat.tools)]
    try:  # TokenizerError: no template, one that does not parse, or one that refused
        shown = not tools or tokenizer.renders_tools
        text = tokenizer.apply_chat_template(messages, tools or None) if shown else ""
    except ValueError as err:
        raise InvalidRequest(f"prompt.chat: {err}", field="prompt.chat") from None
    if not shown:
        raise InvalidRequest(
            "prompt.chat.tools: this model's chat template shows no tools (serve it with "
            "--chat-template, a template that does)",
            field="prompt.chat.tools",
        )
    return tokenizer.encode(text)


def _chat_message(message: pb.ChatMessage, i: int) -> dict[str, Any]:
    """A message as chat templates read it (OpenAI's shape, a call's arguments an object)."""
    where = f"prompt.chat.messages[{i}]"
    if message.role not in CHAT_ROLES:
        raise InvalidRequest(
            f"{where}.role={message.role!r} must be one of {CHAT_ROLES}", field=f"{where}.role"
        )
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name:
        entry["name"] = message.name
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": _json_object(
                        call.arguments, f"{where}.tool_calls[{j}].arguments", empty={}
                    ),
                },
            }
            for j, call in enumerate(message.tool_calls)
        ]
    return entry


def _tool(tool: pb.Tool, where: str) -> dict[str, Any]:
    """A tool as chat templates read it: OpenAI's {"type": "function", "function": ...}."""
    if why := bad_name(tool.name):
        raise InvalidRequest(f"{where}.name={why}", field=f"{where}.name")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        function["parameters"] = _json_object(tool.parameters, f"{where}.parameters", empty={})
    return {"type": "function", "function": function}


def _json_object(text: str, field: str, *, empty: dict[str, Any]) -> dict[str, Any]:
    if not text:
        return empty
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidRequest(f"{field} is not JSON ({err.msg})", field=field) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field}={text!r} must be a JSON object", field=field)
    return value


def to_sampling(
    msg: pb.SamplingParams, *, max_seq_len: int, defaults: SamplingParams
) -> SamplingParams:
    """The engine's sampling of `msg`, an unset field taking `defaults`' value, except
    `max_tokens`: unset, the rest of the context (vLLM's and OpenAI chat's default)."""
    if msg.HasField("max_tokens") and msg.max_tokens > max_seq_len:
        raise InvalidRequest(
            f"max_tokens={msg.max_tokens} exceeds the context: this model serves at most "
            f"max_seq_len={max_seq_len} tokens per sequence",
            field="sampling.max_tokens",
        )
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else max_seq_len,
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else defaults.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=(
            msg.repetition_penalty
            if msg.HasField("repetition_penalty")
            else defaults.repetition_penalty
        ),
        min_p=msg.min_p if msg.HasField("min_p") else defaults.min_p,
        min_tokens=msg.min_tokens,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        stop_token_ids=tuple(msg.stop_token_ids),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=(
            msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        ),
        structured=to_structured(msg.structured) if msg.HasField("structured") else None,
    )


def to_structured(msg: pb.StructuredOutput) -> StructuredOutput:
    """The engine's constraint of `msg`; InvalidRequest naming it if none is set."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequest("structured output sets no constraint", field="sampling.structured")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(msg.choice.options))
    if kind == "json_object":
        return StructuredOutput("json_object")
    return StructuredOutput(kind, spec=getattr(msg, kind))


def logprobs_message(entry: Logprobs, tokenizer: TextCodec | None) -> pb.PositionLogprobs:
    """One position's log-probabilities, each token with its text (none without a
    tokenizer)."""

    def token(token_id: int, logprob: float | None) -> pb.TokenLogprob:
        text = tokenizer.decode([token_id]) if tokenizer is not None else ""
        return pb.TokenLogprob(token_id=token_id, text=text, logprob=logprob)

    return pb.PositionLogprobs(
        token=token(entry.token_id, entry.logprob),
        top=[token(token_id, logprob) for token_id, logprob in entry.top],
    )


def prompt_logprobs_message(
    prompt_ids: list[int], entries: tuple[Logprobs, ...], tokenizer: TextCodec | None
) -> list[pb.PositionLogprobs]:
    """One per prompt token: the first's without a log-probability, then `entries`."""
    text = tokenizer.decode([prompt_ids[0]]) if tokenizer is not None else ""
    first = pb.PositionLogprobs(token=pb.TokenLogprob(token_id=prompt_ids[0], text=text))
    return [first, *(logprobs_message(entry, tokenizer) for entry in entries)]


def adapter_message(info: AdapterInfo) -> pb.Adapter:
    adapter = info.adapter
    return pb.Adapter(
        name=adapter.name,
        path=adapter.path,
        rank=adapter.rank,
        alpha=adapter.alpha,
        target_modules=list(adapter.targets),
        sha256=adapter.sha256,
        size_bytes=adapter.size_bytes,
        state=ADAPTER_STATES.get(info.state, pb.ADAPTER_STATE_UNSPECIFIED),
        slot=info.slot,
        pinned=info.pinned,
        running_requests=info.running_requests,
    )


def sampling_message(sampling: SamplingParams, seed: int) -> pb.SamplingParams:
    """Every field of `sampling` set, with the request's actual `seed` (inverse of
    `to_sampling`)."""
    return pb.SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=seed,
        stop=sampling.stop,
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs,
        prompt_logprobs=sampling.prompt_logprobs,
    )


def _request_message(info: RunningInfo) -> pb.RunningRequest:
    return pb.RunningRequest(
        request_id=info.request_id,
        adapter=info.adapter or "",
        rank=info.rank,
        slot=info.slot,
        prompt_tokens=info.prompt_tokens,
        generated_tokens=info.generated_tokens,
        max_tokens=info.max_tokens,
    )


def cache_message(cache: CacheStats) -> pb.CacheStats:
    return pb.CacheStats(
        policy=cache.policy,
        page_bytes=cache.page_bytes,
        pages_total=cache.pages_total,
        pages_kv=cache.pages_kv,
        pages_kv_cached=cache.pages_kv_cached,
        pages_lora=cache.pages_lora,
        host_bytes_used=cache.host_bytes_used,
        host_bytes_capacity=cache.host_bytes_capacity,
        prompt_tokens=cache.prompt_tokens,
        hit_tokens=cache.hit_tokens,
        swaps_out=cache.swaps_out,
        swaps_in=cache.swaps_in,
        swap_out_bytes=cache.swap_out_bytes,
        swap_in_bytes=cache.swap_in_bytes,
        invalid_kv_pages=cache.invalid_kv_pages,
    )


def stats_message(stats: EngineStats, *, max_queue: int, draining: bool) -> pb.StatsResponse:
    return pb.StatsResponse(
        running=[_request_message(info) for info in stats.running],
        waiting=[_request_message(info) for info in stats.queued],
        queued=stats.waiting,
        max_queue=max_queue,
        max_slots=stats.max_slots,
        free_slots=stats.max_slots - sum(info.slot >= 0 for info in stats.running),
        max_seq_len=stats.max_seq_len,
        memory=pb.Memory(
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_free=stats.kv_blocks_free,
            kv_block_size=stats.kv_block_size,
            host_store_bytes_used=stats.host_store_bytes_used,
            host_store_bytes_capacity=stats.host_store_bytes_capacity,
            device_bytes_in_use=stats.device_bytes_in_use,
            device_bytes_limit=stats.device_bytes_limit,
            kv_bytes_per_block=stats.kv_block_bytes,
            cache=cache_message(stats.cache) if stats.cache is not None else None,
        ),
        adapter_slots=pb.AdapterSlots(
            total=stats.adapter_slots_total,
            free=stats.adapter_slots_free,
            loading=stats.adapter_slots_loading,
            loads=stats.adapter_loads,
            evictions=stats.adapter_evictions,
        ),
        draining=draining,
    )
