"""OpenAI's answers to /v1/completions and /v1/chat/completions, from the workers'
GenerateResponses: whole answers, stream chunks and usage, n choices per prompt (the n
most likely of best_of, by the sum of their tokens' log-probabilities, as vLLM's).

Log-probabilities come in the route's own shape: /v1/completions' (OpenAI's legacy
`tokens`, `token_logprobs`, `top_logprobs` as {text: logprob} with the chosen token among
them, as vLLM gives it, and `text_offset`), chat's (`content`: token, logprob, bytes,
top_logprobs), and vLLM's `prompt_logprobs` (per prompt token, None for the first, else
{token id: {logprob, rank, decoded_token}}; on the choice for completions, on the answer
for chat). With `echo` (completions), the prompt's text and its tokens' entries come
first (the first token's logprob None, as OpenAI gives it).

With tools (chat), each choice's text goes through its tool-call parser
(`jlora.contract.tool_calls`) as it streams: the message's `content` is what is not a
call, its `tool_calls` the calls (a stream's deltas carry each call's id and name first,
then its arguments), and `finish_reason` is "tool_calls" where the model called one by
itself ("auto" or "required"; a named function's call ends with "stop", as OpenAI's).
"""

from __future__ import annotations

import time
from typing import Any

from jlora.api import jlora_pb2 as pb
from jlora.contract import tool_calls
from router.openai_protocol import ChatRequest, CompletionRequest

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


class Answer:
    """The OpenAI objects of one request: `messages[i]`'s responses are choice i."""

    def __init__(
        self,
        request: CompletionRequest | ChatRequest,
        messages: list[pb.GenerateRequest],
        *,
        request_id: str,
        per_prompt: int = 1,
        parsing: tuple[str, str] | None = None,
    ) -> None:
        """`per_prompt`: the choices of each prompt, side by side in `messages`;
        `parsing`: the tool-call parser of each choice's text (None: text)."""
        self.request, self.messages, self.per_prompt = request, messages, per_prompt
        self.parsing = parsing
        # each streamed choice's parser (a whole answer parses each choice's text at once)
        self._parsers = [self._parser() for _ in messages] if parsing and request.stream else []
        self.chat = isinstance(request, ChatRequest)
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.echo = isinstance(request, CompletionRequest) and request.echo
        self._offsets = [0] * len(messages)  # text so far of each choice (completions)

    # -- whole answers --------------------------------------------------------------

    def whole(
        self, sampled: list[list[pb.GenerateResponse]], *, best_of: int | None = None
    ) -> dict[str, Any]:
        """The answer to `sampled`, the responses of every message: `best_of` per prompt
        (None: per_prompt), of which the per_prompt most likely are returned."""
        best_of = best_of or self.per_prompt
        kept = []
        for start in range(0, len(sampled), best_of):
            group = range(start, start + best_of)
            likely = sorted(group, key=lambda i: -sum(r.logprobs.token.logprob for r in sampled[i]))
            kept += sorted(likely[: self.per_prompt])
        self.messages = [self.messages[i] for i in kept]
        answer = self._envelope(
            "chat.completion" if self.chat else "text_completion",
            [self._choice(j, sampled[i]) for j, i in enumerate(kept)],
        )
        answer["usage"] = usage([responses[-1] for responses in sampled], per_prompt=best_of)
        if self.chat and self.request.prompt_logprobs is not None:
            answer["prompt_logprobs"] = _prompt_logprobs(sampled[0][0])
        return answer

    def _choice(self, index: int, responses: list[pb.GenerateResponse]) -> dict[str, Any]:
        text = "".join(response.text for response in responses)
        choice: dict[str, Any] = {"index": index, "logprobs": None}
        finish = _finish(responses[-1])
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if self.parsing:
                parser = self._parser()
                content, calls = tool_calls.whole(parser, text)
                choice["message"]["content"] = content or (None if calls else "")
                if calls:
                    choice["message"]["tool_calls"] = calls
                finish = self._finish_with(parser, finish)
            if self.request.logprobs:
                choice["logprobs"] = _chat_logprobs(responses)
        else:
            first = responses[0]
            prefix = self._echoed(index, first) if self.echo else ""
            choice["text"] = prefix + text
            if self.request.logprobs is not None:
                entries = list(first.prompt_logprobs) if self.echo else []
                choice["logprobs"] = self._completion_logprobs(
                    index, entries + [r.logprobs for r in responses]
                )
            if self.request.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs(first)
        choice["finish_reason"] = finish
        return choice

    # -- streams --------------------------------------------------------------------

    def opening(
        self, index: int, first: pb.GenerateResponse, *, usage: bool
    ) -> list[dict[str, Any]]:
        """A choice's first chunks: the chat role (or, with echo, the prompt), then its
        first token's."""
        chunks = []
        if self.chat:
            chunks.append(self._chunk(index, {"delta": {"role": "assistant", "content": ""}}))
            if self.request.prompt_logprobs is not None:
                chunks[-1]["prompt_logprobs"] = _prompt_logprobs(first)
        elif self.echo:
            fields: dict[str, Any] = {"text": self._echoed(index, first)}
            if self.request.logprobs is not None:
                fields["logprobs"] = self._completion_logprobs(index, list(first.prompt_logprobs))
            chunks.append(self._chunk(index, fields))
        chunks.append(self.chunk(index, first, usage=usage))
        if not self.chat and self.request.prompt_logprobs is not None:
            chunks[0]["choices"][0]["prompt_logprobs"] = _prompt_logprobs(first)
        if usage:
            for chunk in chunks:
                chunk["usage"] = None
        return chunks

    def chunk(self, index: int, response: pb.GenerateResponse, *, usage: bool) -> dict[str, Any]:
        fields: dict[str, Any]
        finish = _finish(response)
        if self.chat:
            fields = {"delta": {"content": response.text}}
            if self.parsing:
                parser = self._parsers[index]
                delta = parser.feed(response.text)
                if finish is not None:
                    delta.add(parser.finish())
                    finish = self._finish_with(parser, finish)
                fields["delta"] = (
                    {"content": delta.content} if delta.content or not delta.calls else {}
                )
                if delta.calls:
                    fields["delta"]["tool_calls"] = [call.openai() for call in delta.calls]
            if self.request.logprobs:
                fields["logprobs"] = _chat_logprobs([response])
        else:
            fields = {"text": response.text}
            if self.request.logprobs is not None:
                fields["logprobs"] = self._completion_logprobs(index, [response.logprobs])
        fields["finish_reason"] = finish
        chunk = self._chunk(index, fields)
        if usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, lasts: list[pb.GenerateResponse]) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        chunk["usage"] = usage(lasts, per_prompt=self.per_prompt)
        return chunk

    # -- parts ----------------------------------------------------------------------

    def _parser(self) -> tool_calls.Parser:
        assert self.parsing is not None
        kind, name = self.parsing
        return tool_calls.parser(kind, name=name)

    def _finish_with(self, parser: tool_calls.Parser, finish: str | None) -> str | None:
        """A choice's finish reason once `parser` has read its text."""
        forced = self.parsing is not None and self.parsing[0] == "named"
        return "tool_calls" if parser.count and not forced and finish == "stop" else finish

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
        }

    def _chunk(self, index: int, fields: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": index, "logprobs": None, "finish_reason": None, **fields}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def _echoed(self, index: int, first: pb.GenerateResponse) -> str:
        """The prompt's text, as sent, or its tokens' texts where it was token ids."""
        message = self.messages[index]
        if message.WhichOneof("prompt") == "text":
            return message.text
        return "".join(entry.token.text for entry in first.prompt_logprobs)

    def _completion_logprobs(
        self, index: int, entries: list[pb.PositionLogprobs]
    ) -> dict[str, Any]:
        """OpenAI's legacy object for `entries`, their text offsets (by the tokens' texts)
        continuing choice `index`'s."""
        tokens, logprobs, tops, offsets = [], [], [], []
        offset = self._offsets[index]
        for entry in entries:
            tokens.append(entry.token.text)
            has = entry.token.HasField("logprob")
            logprobs.append(entry.token.logprob if has else None)
            top = {item.text: item.logprob for item in entry.top}
            if has:
                top.setdefault(entry.token.text, entry.token.logprob)
            tops.append(top if has else None)
            offsets.append(offset)
            offset += len(entry.token.text)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def _chat_logprobs(responses: list[pb.GenerateResponse]) -> dict[str, Any]:
    def token(item: pb.TokenLogprob) -> dict[str, Any]:
        return {"token": item.text, "logprob": item.logprob, "bytes": list(item.text.encode())}

    content = [
        {**token(r.logprobs.token), "top_logprobs": [token(item) for item in r.logprobs.top]}
        for r in responses
    ]
    return {"content": content, "refusal": None}


def _prompt_logprobs(first: pb.GenerateResponse) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for the first token, then each position's tokens."""
    result: list[dict[str, Any] | None] = []
    for entry in first.prompt_logprobs:
        if not entry.token.HasField("logprob"):
            result.append(None)
            continue
        ranks = {item.token_id: rank for rank, item in enumerate(entry.top, start=1)}
        position = {}
        for item in [entry.token, *entry.top]:  # the prompt's token first; rank None: unknown
            position[str(item.token_id)] = {
                "logprob": item.logprob,
                "rank": ranks.get(item.token_id),
                "decoded_token": item.text,
            }
        result.append(position)
    return result


def _finish(response: pb.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(response.finish_reason)


def usage(lasts: list[pb.GenerateResponse], *, per_prompt: int = 1) -> dict[str, Any]:
    """OpenAI's usage object from the last message of every choice sampled (`per_prompt`
    side by side per prompt): the completion tokens of all, each prompt's tokens once
    (its first choice's, and its prefix-cache hits as prompt_tokens_details.cached_tokens)."""
    firsts = lasts[::per_prompt]
    prompt = sum(last.usage.prompt_tokens for last in firsts)
    completion = sum(last.usage.completion_tokens for last in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(last.usage.cached_tokens for last in firsts)
        },
    }
