"""lm-eval-harness itself against `jlora up`: a multiple-choice task's loglikelihoods.

lm-eval's `local-completions` model (the OpenAI completions API with `echo`, `logprobs`
and `max_tokens=1`, prompts sent as token ids in batches) runs the local task in
tests/lm_eval_task (its YAML and data; no network) against a real `jlora up` serving
SmolLM2, for the base model and for a PEFT adapter. Every choice's loglikelihood must
equal transformers' (PEFT's, for the adapter) on the same weights, within 2e-3.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

from bench.lib.processes import ServerProcess
from jlora.cli.up import LISTENING

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TASK = Path(__file__).parent / "lm_eval_task"
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def adapter(hf_smollm2, tmp_path_factory):
    """A PEFT adapter on q/v and the MLP, A and B drawn at random; and PEFT's model."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    model = get_peft_model(copy.deepcopy(hf_smollm2), config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
    path = tmp_path_factory.mktemp("mc-adapter")
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def up(adapter, tmp_path_factory):
    path, _ = adapter
    process = ServerProcess(
        [sys.executable, "-m", "jlora.cli.main", "up", "--port", "0", "--http-port", "0",
         "--state-dir", str(tmp_path_factory.mktemp("state")), "--warmup", "on-demand",
         "--workers", "1", "--max-seq-len", "256", "--adapter", f"mc={path}"],
        LISTENING, stdout="inherit", stderr="log", start_timeout_s=600,
    )  # fmt: skip
    yield process.groups[1].removesuffix("/v1")  # http://host:port
    process.stop(120, group=True)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The task's YAML, its data file given by absolute path."""
    directory = tmp_path_factory.mktemp("tasks")
    text = (TASK / "jlora_mc.yaml").read_text()
    data = TASK / "jlora_mc.jsonl"
    (directory / "jlora_mc.yaml").write_text(text.replace("test: jlora_mc.jsonl", f"test: {data}"))
    return directory


@pytest.mark.parametrize("model", ["smollm2-135m", "mc"])
def test_lm_eval_loglikelihoods_equal_transformers(
    up, task_dir, model, hf_smollm2, adapter, smollm2_gguf_path, monkeypatch
):
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from bench.baselines import hf_model

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = LocalCompletionsAPI(
        base_url=f"{up}/v1/completions",
        model=model,
        tokenizer_backend="huggingface",
        tokenizer=str(hf_model.converted(smollm2_gguf_path, "tokenizer")),
        batch_size=4,
        num_concurrent=1,
        max_retries=1,
    )
    results = simple_evaluate(
        model=lm, tasks=["jlora_mc"], task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
    )  # fmt: skip
    samples = results["samples"]["jlora_mc"]
    assert len(samples) == 8
    reference = adapter[1] if model == "mc" else hf_smollm2

    def loglikelihood(model, context_ids: list[int], continuation_ids: list[int]) -> float:
        with torch.no_grad():
            logits = model(torch.tensor([context_ids + continuation_ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1).numpy()
        start = len(context_ids) - 1
        return float(sum(logprobs[start + i, t] for i, t in enumerate(continuation_ids)))

    differences, adapter_moves = [], []
    for sample in samples:
        doc = sample["doc"]
        context = f"Question: {doc['question']}\nAnswer:"
        for choice, (ours, _) in zip(doc["choices"], sample["filtered_resps"], strict=True):
            pair = lm._encode_pair(context, " " + choice)
            differences.append(abs(float(ours) - loglikelihood(reference, *pair)))
            if model == "mc":  # the adapter's loglikelihoods are not the base model's
                adapter_moves.append(abs(float(ours) - loglikelihood(hf_smollm2, *pair)))
    assert len(differences) == 24 and max(differences) <= TOLERANCE, max(differences)
    assert model != "mc" or max(adapter_moves) > 0.1
    assert 0.0 <= results["results"]["jlora_mc"]["acc,none"] <= 1.0
