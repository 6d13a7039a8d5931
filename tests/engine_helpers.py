"""Running requests through an engine in tests."""

from __future__ import annotations

from configs import EngineConfig
from jlora.engine.api import Engine, Request, SamplingParams
from jlora.engine.engine import LLMEngine


def make_engine(loaded, **config) -> LLMEngine:
    return LLMEngine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        engine_config=EngineConfig(**config),
    )


def run_to_completion(
    engine: Engine,
    prompts: list[list[int]],
    sampling: SamplingParams | list[SamplingParams],
    adapters: list[str | None] | None = None,
) -> list[dict]:
    """Queue every prompt at once (prompt i with adapters[i]), step until done; per
    prompt: token_ids, text, finish_reason."""
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    names = adapters if adapters is not None else [None] * len(prompts)
    for i, (ids, params, name) in enumerate(zip(prompts, samplings, names, strict=True)):
        engine.add_request(Request(f"r{i}", ids, params, adapter=name))
    results = {
        f"r{i}": {"token_ids": [], "text": "", "finish_reason": None} for i in range(len(prompts))
    }
    while engine.has_unfinished:
        for event in engine.step():
            result = results[event.request_id]
            assert result["finish_reason"] is None, "event after the request finished"
            result["token_ids"].append(event.token_id)
            result["text"] += event.text
            result["finish_reason"] = event.finish_reason
    return [results[f"r{i}"] for i in range(len(prompts))]
