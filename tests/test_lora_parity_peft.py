"""Multi-LoRA on SmolLM2 against PEFT's mixed-adapter batches (PyTorch).

Three adapters made by PEFT itself (different ranks, target sets, and rank-stabilised
scaling for one), with random non-zero weights strong enough to change the greedy
continuation, are served in one batch with base-model rows. PEFT runs the same batch
with `adapter_names=` per row. Tokens must be equal and logits within the policy.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from configs.engine import LORA_BACKENDS
from jlora.engine.api import SamplingParams
from tests.engine_helpers import make_engine, run_to_completion
from tests.model_helpers import jlora_last_logits
from tests.tolerances import assert_close

pytestmark = pytest.mark.slow

# name -> LoraConfig arguments. Ranks 8, 12 (not a power of two) and 32.
ADAPTERS = {
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-r12-rslora": dict(
        r=12,
        lora_alpha=8,
        use_rslora=True,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "mlp-o-r32": dict(
        r=32, lora_alpha=64, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
}
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "The capital of France is",
    "My favourite colour is",
]
ROW_ADAPTERS = ["qv-r8", None, "all-r12-rslora", "mlp-o-r32", None, "qv-r8"]
NEW_TOKENS = 12
# The Pallas kernels run interpreted here, each program of their grids an iteration of
# an XLA loop (MBGMV's decode step: about 1 s, 5x BGMV's): they serve the batch for
# fewer tokens, and check the prefill logits of one row per adapter and a base row.
PALLAS_TOKENS = 4
PALLAS_ROWS = 4


@pytest.fixture(scope="module")
def peft_dirs(tmp_path_factory, hf_smollm2):
    """PEFT-made adapters: lora_A and lora_B drawn at random (PEFT would zero B)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("peft")
    paths = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        model = get_peft_model(copy.deepcopy(hf_smollm2), LoraConfig(**kwargs))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_A" in param_name:  # [r, in]: x @ A^T has entries ~ rms(x)
                    param.copy_(
                        torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5
                    )
                elif "lora_B" in param_name:  # [out, r]
                    param.copy_(
                        torch.randn(param.shape, generator=generator) * 0.5 / param.shape[1] ** 0.5
                    )
        model.save_pretrained(str(root / name))
        paths[name] = root / name
    return paths


@pytest.fixture(scope="module")
def peft_model(hf_smollm2, peft_dirs):
    from peft import PeftModel

    names = list(peft_dirs)
    model = PeftModel.from_pretrained(
        copy.deepcopy(hf_smollm2), str(peft_dirs[names[0]]), adapter_name=names[0]
    )
    for name in names[1:]:
        model.load_adapter(str(peft_dirs[name]), adapter_name=name)
    return model.eval()


def _left_padded(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, batch))
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, tokens in enumerate(batch):
        ids[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = 1
    return ids, mask


def _peft_names(rows):
    return [name if name is not None else "__base__" for name in rows]


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


def test_mixed_batch_greedy_tokens_match_peft(peft_model, prompt_ids, reference_tokens):
    ids, mask = _left_padded(prompt_ids)
    with torch.no_grad():
        generated = peft_model.generate(
            input_ids=ids,
            attention_mask=mask,
            adapter_names=_peft_names(ROW_ADAPTERS),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
        )
    theirs = generated[:, ids.shape[1] :].tolist()
    with torch.no_grad(), peft_model.disable_adapter():
        base = peft_model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        )[:, ids.shape[1] :].tolist()
    for row, name in enumerate(ROW_ADAPTERS):
        if name is not None:
            assert theirs[row] != base[row], f"adapter {name} does not change row {row}"

    assert reference_tokens == theirs


def _serve_mixed_batch(
    smollm2, peft_dirs, prompt_ids, backend: str, new_tokens: int = NEW_TOKENS, **overrides
) -> list[list[int]]:
    """Four decode slots for six prompts and two device slots for three adapters: requests
    wait for slots, adapters are loaded on demand and evicted while others decode (under
    "lru", vLLM's static share, whose max_loras slots bind even where the adapters live
    in the pool's pages)."""
    engine = make_engine(
        smollm2,
        max_slots=4,
        max_seq_len=128,
        max_loras=2,
        max_lora_rank=32,
        lora_backend=backend,
        **{"cache_policy": "lru", **overrides},
    )
    for name, path in peft_dirs.items():
        engine.register_adapter(name, str(path))
    # Each shape compiles when first met, except where CPU assistance must find every
    # adapter cold: a compile mid-run would let adapters land first.
    engine.warmup(
        prompt_lengths=[len(ids) for ids in prompt_ids],
        max_length=64,
        on_demand=engine.config.lora_mode != "cpu-assist",
    )
    ours = run_to_completion(
        engine,
        prompt_ids,
        SamplingParams(max_tokens=new_tokens, ignore_eos=True),
        ROW_ADAPTERS,
    )
    assert engine.adapters.slots.stats()["evictions"] >= 1
    if engine.config.lora_mode == "cpu-assist":
        assert engine.counters["assisted_prefills"] >= 3  # every adapter arrives cold
    engine.close()
    return [r["token_ids"] for r in ours]


@pytest.fixture(scope="module")
def reference_tokens(smollm2, peft_dirs, prompt_ids):
    return _serve_mixed_batch(smollm2, peft_dirs, prompt_ids, "reference")


@pytest.mark.parametrize("backend", ["bgmv", "mbgmv"])
def test_pallas_backends_give_the_reference_tokens(
    smollm2, peft_dirs, prompt_ids, reference_tokens, backend
):
    """SGMV prefill and BGMV / MBGMV decode (interpreted on CPU) in the same mixed batch:
    the reference backend's first tokens (a request's greedy tokens do not depend on its
    max_tokens)."""
    served = _serve_mixed_batch(smollm2, peft_dirs, prompt_ids, backend, PALLAS_TOKENS)
    assert served == [tokens[:PALLAS_TOKENS] for tokens in reference_tokens]


def test_cpu_assisted_prefill_gives_the_reference_tokens(
    smollm2, peft_dirs, prompt_ids, reference_tokens
):
    """Cold adapters over a throttled link (about 2 s each, in 4 layer groups): their
    prompts prefill at once with the LoRA of layers still in flight on CPU workers."""
    served = _serve_mixed_batch(
        smollm2,
        peft_dirs,
        prompt_ids,
        "reference",
        lora_mode="cpu-assist",
        emulated_link_gbps=0.02,
        cpu_workers=1,
    )
    assert served == reference_tokens


@pytest.mark.parametrize("backend", LORA_BACKENDS)
def test_prefill_logits_match_peft(smollm2, peft_model, peft_dirs, prompt_ids, backend):
    engine = make_engine(
        smollm2,
        max_slots=1,
        max_seq_len=64,
        max_loras=3,
        max_lora_rank=32,
        lora_mode="cached",
        lora_backend=backend,
    )
    for name, path in peft_dirs.items():
        engine.register_adapter(name, str(path))
    engine.adapters.wait_pinned()  # cached mode: all on the device
    ids, mask = _left_padded(prompt_ids)
    with torch.no_grad():
        theirs = (
            peft_model(input_ids=ids, attention_mask=mask, adapter_names=_peft_names(ROW_ADAPTERS))
            .logits[:, -1]
            .numpy()
        )
    rows = PALLAS_ROWS if backend != "reference" else len(prompt_ids)
    assert set(ROW_ADAPTERS[:PALLAS_ROWS]) == set(ROW_ADAPTERS)
    for row, (tokens, name) in enumerate(zip(prompt_ids[:rows], ROW_ADAPTERS[:rows], strict=True)):
        logits = jlora_last_logits(smollm2, tokens, bucket=32, engine=engine, adapter=name)
        assert_close(logits, theirs[row], jnp.float32, np.float32, scope="model")
    engine.close()
