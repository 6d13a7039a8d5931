"""The jlora.v1 messages a client sends and what it makes of the replies.

`generate_request` builds a GenerateRequest from a prompt (text, token ids or chat
messages), an adapter and sampling fields given by name: every field of
`jlora.v1.SamplingParams` is accepted as it is spelled in the .proto, so a field the API
gains passes through without a change here. `Completion.of` gathers a Generate stream
into one result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jlora.api import jlora_pb2 as pb

# A prompt: text (encoded with the model's tokenizer) or token ids (used as given).
Prompt = str | Sequence[int]
# Chat messages, rendered with the model's chat template: {"role": ..., "content": ...}
# mappings (with "name" and "tool_call_id" where given), (role, content) pairs or
# ChatMessage messages; or a ChatMessages message, which also carries the tools offered.
Chat = Sequence[Mapping[str, str] | tuple[str, str] | pb.ChatMessage] | pb.ChatMessages


def sampling_params(sampling: pb.SamplingParams | None = None, **fields: Any) -> pb.SamplingParams:
    """A copy of `sampling` (default: empty) with `fields` set by their .proto names.

    A value of None leaves the field unset (the server's default); a repeated field takes
    a sequence, or one string (`stop="\\n"`); a map field, a mapping (`logit_bias`).
    TypeError for a name SamplingParams does not have; protobuf's TypeError or ValueError
    for a value its field cannot hold. The server checks the rest (INVALID_ARGUMENT naming
    `sampling.<field>`).
    """
    params = pb.SamplingParams()
    if sampling is not None:
        params.CopyFrom(sampling)
    known = params.DESCRIPTOR.fields_by_name
    for name, value in fields.items():
        field = known.get(name)
        if field is None:
            raise TypeError(
                f"{name!r} is not a field of jlora.v1.SamplingParams (it has: {', '.join(known)})"
            )
        params.ClearField(name)
        if value is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            getattr(params, name).update(value)
        elif field.is_repeated:
            getattr(params, name).extend([value] if isinstance(value, str) else value)
        elif field.message_type is not None:
            getattr(params, name).CopyFrom(value)
        else:
            setattr(params, name, value)
    return params


def generate_request(
    prompt: Prompt | None = None,
    *,
    chat: Chat | None = None,
    adapter: str | None = None,
    request_id: str = "",
    resume: pb.ResumeState | None = None,
    sampling: pb.SamplingParams | None = None,
    **fields: Any,
) -> pb.GenerateRequest:
    """The GenerateRequest of a prompt or chat messages (exactly one), on `adapter` (None:
    the base model), with `sampling` and the sampling `fields` (`sampling_params`)."""
    if (prompt is None) == (chat is None):
        raise TypeError("give a prompt (text or token ids) or chat messages: exactly one")
    request = pb.GenerateRequest(
        request_id=request_id,
        adapter=adapter or "",
        sampling=sampling_params(sampling, **fields),
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    else:
        assert chat is not None
        request.chat.SetInParent()  # an empty conversation is the server's to refuse
        if isinstance(chat, pb.ChatMessages):
            request.chat.CopyFrom(chat)
        else:
            request.chat.messages.extend(_chat_message(message) for message in chat)
    if resume is not None:
        request.resume.CopyFrom(resume)
    return request


def _chat_message(message: Mapping[str, str] | tuple[str, str] | pb.ChatMessage) -> pb.ChatMessage:
    if isinstance(message, pb.ChatMessage):
        return message
    if isinstance(message, tuple):
        role, content = message
        return pb.ChatMessage(role=role, content=content)
    return pb.ChatMessage(
        role=message["role"],
        content=message["content"],
        name=message.get("name", ""),
        tool_call_id=message.get("tool_call_id", ""),
    )


@dataclasses.dataclass(frozen=True)
class Completion:
    """A whole Generate stream.

    text: the streamed texts joined (stop strings excluded). token_ids: the generated
    tokens, in order. finish_reason: "stop" (end of sequence or a stop string) or
    "length" (max_tokens or the context). usage: the last message's. logprobs: each
    generated token's log-probabilities, when the request set `logprobs` (else None).
    prompt_logprobs: each prompt token's, when it set `prompt_logprobs` (else None).
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: pb.Usage
    logprobs: list[pb.PositionLogprobs] | None = None
    prompt_logprobs: list[pb.PositionLogprobs] | None = None

    @classmethod
    def of(cls, responses: Sequence[pb.GenerateResponse]) -> Completion:
        """The completion a Generate stream's `responses` make (one at least: the last
        carries the finish reason and the usage)."""
        first, last = responses[0], responses[-1]
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_")
        return cls(
            request_id=last.request_id,
            text="".join(r.text for r in responses),
            token_ids=[r.token_id for r in responses],
            finish_reason=reason.lower(),
            usage=last.usage,
            logprobs=[r.logprobs for r in responses] if first.HasField("logprobs") else None,
            prompt_logprobs=list(first.prompt_logprobs) or None,
        )
