"""OpenAI's (and vLLM's) request bodies for /v1/completions and /v1/chat/completions, as
pydantic models, and the `jlora.v1` GenerateRequests they become.

Every field a client may send is one of: honoured (its meaning is OpenAI's, or vLLM's
for vLLM's extensions); accepted and ignored (`IGNORED`: it changes nothing a model
computes, as `user`); or known but not served yet (`NOT_YET`: accepted only at its
neutral value, any other is a 400 naming it). Any other field is a 400 naming it, as
OpenAI answers "Unrecognized request argument". Types are strict (the string "9" is not
a number), and a wrong one is a 400 naming the field by its path in the body
(`messages[0].content`).

Tools (chat): `tools` go to the worker, whose chat template shows them; `tool_choice`
"auto" (the default with tools) parses the reply in the format the model's template asks
for (`jlora.contract.tool_calls`; a 400 where the worker knows none), "required" and a
named function shape the reply with a grammar (`forced_schema`; at most one call with
`parallel_tool_calls` false), "none" leaves it text. `tool_parsing` says which parser a
request's answer takes. An assistant message's `tool_calls` and a tool message's
`tool_call_id` go to the template as OpenAI's shape.

Defaults, as vLLM's: unset sampling fields take the worker's (the model's
`generation_config`, else greedy); `max_tokens` unset is 16 for /v1/completions
(OpenAI's) and the rest of the context for chat. The ranges of the sampling fields are
the worker's to check (its errors name the body's field).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from jlora.api import jlora_pb2 as pb
from jlora.contract.tool_calls import bad_name, forced_schema
from router.http_body import HttpError

INT32_MAX = 2**31 - 1
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 128  # n and best_of at most (OpenAI's n limit)
IGNORED = ("user", "metadata", "store", "service_tier")
# Known fields jlora does not serve yet, by the only value it accepts (None always is).
NOT_YET: dict[str, Any] = {"suffix": "", "functions": [], "function_call": "none"}
# A message's fields, by role (content is any role's).
MESSAGE_FIELDS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # ignored: usage comes in the last chunk


class _Generate(_Body):
    """The fields both routes share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's; -1 (vLLM's "off") is 0
    seed: int | None = None
    stop: Any = None  # a string or a list of them (checked by hand)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token ids (as strings) -> bias
    # vLLM's
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    n: int = 1
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    # accepted, ignored
    user: str | None = None


class CompletionRequest(_Generate):
    prompt: Any = None  # a string, token ids, or a batch of either (checked by hand)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None  # sampled per prompt, the n most likely returned


class Function(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # a forced choice's grammar is strict anyway


class Tool(_Body):
    type: Literal["function"]
    function: Function


class ChatRequest(_Generate):
    messages: Any = None  # checked by hand, naming messages[i]...
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None  # checked by hand (`tool_parsing`)
    functions: list[Any] | None = None
    function_call: Any = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None


def choices(request: CompletionRequest | ChatRequest) -> tuple[int, int]:
    """(n, best_of): the choices returned per prompt and those sampled (400 naming the
    field unless 1 <= n <= best_of <= MAX_CHOICES, and a stream samples no more than it
    returns, as OpenAI's)."""
    n = request.n
    best_of = getattr(request, "best_of", None) or n
    if not 1 <= n <= MAX_CHOICES:
        raise HttpError(400, f"n={n} must be in [1, {MAX_CHOICES}]", param="n")
    if not n <= best_of <= MAX_CHOICES:
        raise HttpError(
            400, f"best_of={best_of} must be in [n={n}, {MAX_CHOICES}]", param="best_of"
        )
    if request.stream and best_of > n:
        raise HttpError(400, f"best_of={best_of} > n={n} cannot be streamed", param="best_of")
    return n, best_of


def parse(kind: type[_Generate], body: dict[str, Any]) -> Any:
    """The body as `kind`, or a 400 naming the first field that is wrong."""
    try:
        request = kind.model_validate(body)
    except ValidationError as err:
        error = err.errors()[0]
        param = _path(error["loc"])
        if error["type"] == "extra_forbidden":
            raise HttpError(
                400,
                f"{param} is not a field jlora accepts in this request (OpenAI's and vLLM's "
                "are listed in docs/serving.md)",
                param=param,
            ) from None
        raise HttpError(400, f"{param}={error['input']!r}: {error['msg']}", param=param) from None
    for field, neutral in NOT_YET.items():
        value = getattr(request, field, None)
        if value is not None and value != neutral:
            raise HttpError(
                400,
                f"{field}={value!r} is not supported yet (accepted: {neutral!r}, or unset)",
                param=field,
            )
    return request


def _path(loc: tuple) -> str:
    """A pydantic error location as the body's path: messages[0].content."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


# -- to GenerateRequests --------------------------------------------------------------


def completion_messages(request: CompletionRequest) -> list[pb.GenerateRequest]:
    """One GenerateRequest per choice sampled (`choices`' best_of per prompt of the
    batch, prompt by prompt)."""
    messages = []
    for prompt in _prompts(request.prompt):
        message = _base(request, chat=False)
        if isinstance(prompt, str):
            message.text = prompt
        else:
            message.token_ids.SetInParent()
            message.token_ids.ids.extend(prompt)
        sampling = message.sampling
        if request.logprobs is not None:
            sampling.logprobs = request.logprobs
        if request.echo:  # the prompt's tokens come back with their texts
            sampling.prompt_logprobs = max(sampling.prompt_logprobs, request.logprobs or 0)
        n, best_of = choices(request)
        if best_of > n and not sampling.HasField("logprobs"):
            sampling.logprobs = 0  # the choices are ranked by their tokens' log-probabilities
        messages += siblings(message, best_of)
    return messages


def siblings(message: pb.GenerateRequest, count: int) -> list[pb.GenerateRequest]:
    """`count` copies of `message`, choice j's seed the request's plus j (mod 2**32):
    the same seed gives the same choices; unset, each draws its own."""
    copies = [message]
    for j in range(1, count):
        copy = pb.GenerateRequest()
        copy.CopyFrom(message)
        if message.sampling.HasField("seed"):
            copy.sampling.seed = (message.sampling.seed + j) % 2**32
        copies.append(copy)
    return copies


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A string, token ids, or a non-empty batch of either."""

    def ids(value: Any) -> bool:
        return isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and -INT32_MAX <= t <= INT32_MAX
            for t in value
        )

    if isinstance(prompt, str) or (ids(prompt) and prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
        return list(prompt)
    if prompt == []:
        raise HttpError(400, "prompt is empty", param="prompt")
    raise HttpError(
        400,
        f"prompt={prompt!r} must be a string, a list of token ids, or a list of either",
        param="prompt",
    )


def chat_message(request: ChatRequest, parsing: tuple[str, str] | None) -> pb.GenerateRequest:
    """The request's GenerateRequest; `parsing` is its `tool_parsing`."""
    message = _base(request, chat=True)
    messages = request.messages
    if not isinstance(messages, list):
        raise HttpError(400, f"messages={messages!r} must be a list of messages", param="messages")
    message.chat.SetInParent()
    for i, item in enumerate(messages):
        _chat_item(item, f"messages[{i}]", message.chat.messages.add())
    for tool in request.tools or ():
        message.chat.tools.add(
            name=tool.function.name,
            description=tool.function.description or "",
            parameters=json.dumps(tool.function.parameters) if tool.function.parameters else "",
        )
    sampling = message.sampling
    if parsing is not None and parsing[0] in ("named", "required"):
        if sampling.HasField("structured"):
            param = "structured_outputs" if request.structured_outputs else "response_format"
            raise HttpError(
                400,
                f"tool_choice={request.tool_choice!r} shapes the reply with a grammar of its "
                f"own: {param} goes with tool_choice 'auto' or 'none' only",
                param="tool_choice",
            )
        schema = forced_schema(
            [tool.model_dump() for tool in request.tools or ()],
            request.tool_choice,
            parallel=request.parallel_tool_calls is not False,
        )
        sampling.structured.json_schema = json.dumps(schema)
    if request.top_logprobs is not None and not request.logprobs:
        raise HttpError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if request.logprobs:
        sampling.logprobs = request.top_logprobs or 0
    return message


def chat_messages(
    request: ChatRequest, parsing: tuple[str, str] | None = None
) -> list[pb.GenerateRequest]:
    """One GenerateRequest per choice (n)."""
    return siblings(chat_message(request, parsing), choices(request)[0])


def tool_parsing(request: ChatRequest, model_format: str) -> tuple[str, str] | None:
    """How the answer's text becomes tool calls: (parser kind, function name) for
    `jlora.contract.tool_calls.parser`, or None (text). `model_format`: the parser the
    model's worker reports ("" for none). 400 naming the field where the tools or the
    choice are not well formed, or "auto" has no parser."""
    tools, choice = request.tools or [], request.tool_choice
    names = [tool.function.name for tool in tools]
    for i, name in enumerate(names):
        if why := bad_name(name):
            param = f"tools[{i}].function.name"
            raise HttpError(400, f"{param}={why}", param=param)
        if name in names[:i]:
            param = f"tools[{i}].function.name"
            raise HttpError(400, f"{param}={name!r} names another tool too", param=param)
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or set(choice) != {"type", "function"}:
            raise HttpError(
                400,
                f"tool_choice={choice!r} must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if not isinstance(named, str) or named not in names:
            raise HttpError(
                400,
                f"tool_choice.function.name={named!r} is not one of the tools {names}",
                param="tool_choice.function.name",
            )
        return "named", named
    if choice not in ("none", "auto", "required"):
        raise HttpError(
            400,
            f"tool_choice={choice!r} must be 'none', 'auto', 'required' or a named function",
            param="tool_choice",
        )
    if choice != "none" and not tools:
        raise HttpError(400, f"tool_choice={choice!r} needs tools", param="tool_choice")
    if choice == "none":
        return None
    if choice == "required":
        return "required", ""
    if not model_format:
        raise HttpError(
            400,
            f"tool_choice='auto': model {request.model!r} writes tool calls in no format jlora "
            "parses (start its workers with --tool-call-parser, or --chat-template a template "
            "that asks for one); tool_choice 'required' or a named function works with any",
            param="tool_choice",
        )
    return model_format, ""


def _chat_item(item: Any, where: str, out: pb.ChatMessage) -> None:
    """OpenAI's message `item` into `out` (400 naming its field where it is wrong)."""
    if not isinstance(item, dict):
        raise HttpError(400, f"{where}={item!r} must be an object", param=where)
    role = item.get("role")
    if not isinstance(role, str):
        raise HttpError(400, f"{where}.role={role!r} must be a string", param=f"{where}.role")
    unknown = set(item) - {"role", "content", "name"} - MESSAGE_FIELDS.get(role, set())
    if unknown:
        field = f"{where}.{sorted(unknown)[0]}"
        raise HttpError(400, f"{field} is not a field of a {role!r} message", param=field)
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
    out.role, out.content = ("system" if role == "developer" else role), content
    out.name = _string(item, "name", where)
    out.tool_call_id = _string(item, "tool_call_id", where)
    calls = item.get("tool_calls") or []
    if not isinstance(calls, list):
        raise HttpError(
            400, f"{where}.tool_calls must be a list of calls", param=f"{where}.tool_calls"
        )
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise HttpError(
                400,
                f'{at}={call!r} must be {{"id", "type": "function", "function": {{"name", '
                '"arguments"}}',
                param=at,
            )
        arguments = _string(function, "arguments", f"{at}.function")
        try:
            valid = isinstance(json.loads(arguments or "{}"), dict)
        except json.JSONDecodeError:
            valid = False
        if not valid:
            param = f"{at}.function.arguments"
            raise HttpError(400, f"{param}={arguments!r} must be a JSON object", param=param)
        out.tool_calls.add(
            id=_string(call, "id", at),
            name=_string(function, "name", f"{at}.function"),
            arguments=arguments,
        )


def _string(item: dict[str, Any], field: str, where: str) -> str:
    value = item.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        param = f"{where}.{field}"
        raise HttpError(400, f"{param}={value!r} must be a string", param=param)
    return value


def _text_part(part: object, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise HttpError(400, f"{where}={part!r}: only text parts are supported", param=where)


def _base(request: _Generate, *, chat: bool) -> pb.GenerateRequest:
    """The adapter and the sampling fields; the prompt is the caller's."""
    if not request.model:
        raise HttpError(400, "model='' must be a model id (see /v1/models)", param="model")
    message = pb.GenerateRequest(adapter=request.model)
    sampling = message.sampling
    field = "max_tokens"
    max_tokens = request.max_tokens
    if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        field, max_tokens = "max_completion_tokens", request.max_completion_tokens
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_MAX_TOKENS
    if max_tokens is not None:
        sampling.max_tokens = _int32(field, max_tokens)
    if request.temperature is not None:
        sampling.temperature = request.temperature
    if request.top_p is not None:
        sampling.top_p = request.top_p
    if request.top_k is not None:
        sampling.top_k = 0 if request.top_k == -1 else _int32("top_k", request.top_k)
    if request.seed is not None:
        if not 0 <= request.seed < 2**64:
            raise HttpError(400, f"seed={request.seed} must be in [0, 2**64)", param="seed")
        sampling.seed = request.seed
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(item, str) for item in stop):
            raise HttpError(
                400, f"stop={stop!r} must be a string or a list of strings", param="stop"
            )
        sampling.stop.extend(stop)
    sampling.ignore_eos = request.ignore_eos
    if request.prompt_logprobs is not None:
        sampling.prompt_logprobs = request.prompt_logprobs
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if (value := getattr(request, name)) is not None:
            setattr(sampling, name, value)
    if request.min_tokens is not None:
        sampling.min_tokens = _int32("min_tokens", request.min_tokens)
    for key, bias in (request.logit_bias or {}).items():
        if not key.isdigit() or int(key) > INT32_MAX:
            raise HttpError(
                400, f"logit_bias has the key {key!r}: keys are token ids", param="logit_bias"
            )
        sampling.logit_bias[int(key)] = bias
    for i, token in enumerate(request.stop_token_ids or ()):
        sampling.stop_token_ids.append(_int32(f"stop_token_ids[{i}]", token))
    sampling.include_stop_str_in_output = bool(request.include_stop_str_in_output)
    if request.skip_special_tokens is not None:
        sampling.skip_special_tokens = request.skip_special_tokens
    _structured(request, sampling.structured)
    if not sampling.structured.WhichOneof("constraint"):
        sampling.ClearField("structured")
    return message


STRUCTURED = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's structured_outputs


def _structured(request: _Generate, out: pb.StructuredOutput) -> None:
    """OpenAI's response_format or vLLM's structured_outputs into `out` (400 naming the
    field where it is not one constraint of a known kind)."""
    form, vllm = request.response_format, request.structured_outputs
    if form is not None and vllm:
        raise HttpError(
            400, "give response_format or structured_outputs, not both", param="structured_outputs"
        )
    if form is not None:
        kind = form.get("type")
        if kind == "json_object":
            out.json_object = True
        elif kind == "json_schema":
            spec = form.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise HttpError(
                    400,
                    "response_format.json_schema.schema must be a JSON schema object",
                    param="response_format.json_schema.schema",
                )
            out.json_schema = json.dumps(schema)
        elif kind != "text":
            raise HttpError(
                400,
                f"response_format.type={kind!r} is not one of 'text', 'json_object', 'json_schema'",
                param="response_format.type",
            )
    if vllm:
        given = [key for key in vllm if vllm[key] not in (None, False)]
        unknown = sorted(set(vllm) - set(STRUCTURED))
        if unknown:
            param = f"structured_outputs.{unknown[0]}"
            raise HttpError(400, f"{param} is not one of {list(STRUCTURED)}", param=param)
        if len(given) != 1:
            raise HttpError(
                400,
                f"structured_outputs sets {given or 'nothing'}: it takes exactly one of "
                f"{list(STRUCTURED)}",
                param="structured_outputs",
            )
        (key,) = given
        value, param = vllm[key], f"structured_outputs.{key}"
        if key == "json":
            out.json_schema = value if isinstance(value, str) else json.dumps(value)
        elif key == "json_object":
            out.json_object = True
        elif key == "choice":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise HttpError(400, f"{param} must be a list of strings", param=param)
            out.choice.options.extend(value)
        elif isinstance(value, str):
            setattr(out, key, value)
        else:
            raise HttpError(400, f"{param} must be a string", param=param)


def _int32(field: str, value: int) -> int:
    if not -INT32_MAX <= value <= INT32_MAX:
        raise HttpError(
            400, f"{field}={value} is out of range [{-INT32_MAX}, {INT32_MAX}]", param=field
        )
    return value
