"""dLoRA's merged inference as a state of the device engine (device_api.py, llama_engine.py,
jlora/model/merge.py, mock.py).

The engines are driven as the orchestrator drives them (prefill, insert, generate, free;
`drive`), without its scheduling policy. Merged and unmerged serve the same greedy
tokens, on the tiny random model and on SmolLM2 with PEFT-made adapters (an rsLoRA one
with all seven targets among them), with logits within the policy; the merged kernels
are the base plus the adapter's delta, only for its own targets; unmerging puts every
parameter back bit for bit (bf16 included); merged steps run no LoRA and, after
warm-up, nothing compiles; a row or a job of another adapter or of the base model while
merged raises AssertionError, in the JAX engine and in the mock; a sharded merge equals
the single-device one (tests/sharded_checks.py); `EngineConfig.merge` is validated.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import MERGE_MODES, ConfigError, EngineConfig
from jlora.adapters.peft import make_demo_adapters
from jlora.device.llama_engine import LlamaEngine
from jlora.engine.device_api import DecodeRow, DeviceEngine, PrefillJob, SamplingRow
from jlora.engine.mock import MockEngine, mock_adapter_dir, mock_completion
from jlora.model.lora.targets import TARGETS
from tests.model_helpers import jlora_last_logits
from tests.tolerances import assert_close, tolerances

NEW_TOKENS = 16


def greedy(step: int) -> SamplingRow:
    return SamplingRow(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=step)


def drive(
    device: DeviceEngine, prompts: list[list[int]], slots: list[int], new_tokens: int
) -> list[list[int]]:
    """Greedy tokens of each prompt as the orchestrator runs them: prompt i is prefilled on
    adapter slot slots[i] (-1: the base model) into its own blocks, inserted into decode
    row i, and all rows decode together until each has `new_tokens`; then freed."""
    cfg = device.config
    out = []
    for row, (ids, slot) in enumerate(zip(prompts, slots, strict=True)):
        table = np.full(cfg.blocks_per_seq, cfg.num_blocks, np.int32)
        used = -(-(len(ids) + new_tokens) // cfg.block_size)
        table[:used] = row * cfg.blocks_per_seq + np.arange(used)
        first = device.prefill(PrefillJob(ids, table, greedy(0), adapter_slot=slot)).token
        device.insert(row, DecodeRow(first, len(ids), table, greedy(1), adapter_slot=slot))
        out.append([first])
    for _ in range(new_tokens - 1):
        tokens = device.generate()
        for row, generated in enumerate(out):
            generated.append(int(tokens[row]))
    for row in range(len(out)):
        device.free(row)
    return out


def install(device: DeviceEngine, paths: dict) -> dict[str, int]:
    """Stage every adapter and put adapter i in device slot i: name -> slot."""
    for slot, (name, path) in enumerate(paths.items()):
        device.stage_adapter(name, str(path))
        device.install_adapter(name, slot, device.load_adapter(name, slot))
    return {name: slot for slot, name in enumerate(paths)}


def host_copy(params) -> list[np.ndarray]:
    return [np.array(leaf) for leaf in jax.tree.leaves(params)]


def assert_restored(device: LlamaEngine, before: list[np.ndarray]) -> None:
    """The pristine arrays themselves are back, and every value is bit for bit as before."""
    assert device.merged is None and device.params is device.base_params
    after = jax.tree.leaves(device.params)
    assert len(after) == len(before)
    for old, new in zip(before, after, strict=True):
        assert old.dtype == new.dtype and np.array_equal(old, np.asarray(new))


def assert_only_targets_merged(device: LlamaEngine, targets: tuple[str, ...]) -> None:
    """The adapter's targets are new arrays with the base kernels' shardings; every other
    parameter is the pristine array itself."""
    merged, base = device.params, device.base_params
    for key in merged:
        if key != "layers":
            assert merged[key] is base[key]
    for part, leaves in merged["layers"].items():  # the projections and the norms
        if part in targets:
            kernel, pristine = leaves["kernel"], base["layers"][part]["kernel"]
            assert kernel is not pristine and kernel.sharding == pristine.sharding
            assert kernel.dtype == pristine.dtype and kernel.shape == pristine.shape
        else:
            assert leaves is base["layers"][part], part
    nbytes = sum(merged["layers"][target]["kernel"].nbytes for target in targets)
    assert device.memory().merged_weights == nbytes


# -- the tiny model ---------------------------------------------------------------------

TINY_ADAPTERS = {  # name -> (rank, targets)
    "all-r4": (4, TARGETS),
    "all-r12": (12, TARGETS),
    "qv-r8": (8, ("q_proj", "v_proj")),
}


@pytest.fixture(scope="module")
def tiny_paths(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("merge-demo")
    paths = {}
    for seed, (name, (rank, targets)) in enumerate(TINY_ADAPTERS.items()):
        (path,) = make_demo_adapters(
            tiny.config, root / name, n=1, ranks=[rank], targets=targets, seed=seed
        )
        paths[name] = path
    return paths


def _tiny_engine(tiny, params=None, **config) -> LlamaEngine:
    engine_config = EngineConfig(
        max_slots=3, max_seq_len=32, min_bucket=16, max_loras=3, max_lora_rank=32, **config
    )
    return LlamaEngine(
        model_config=tiny.config,
        params=tiny.params if params is None else params,
        tokenizer=None,
        engine_config=engine_config,
    )


@pytest.fixture(scope="module")
def tiny_device(tiny, tiny_paths):
    """A warmed-up tiny engine with merging on, the three adapters in slots 0, 1, 2."""
    device = _tiny_engine(tiny, merge="auto")
    slots = install(device, tiny_paths)
    device.warmup(prompt_lengths=[5, 11], max_length=32)
    yield SimpleNamespace(device=device, slots=slots)
    device.close()


def _prompts(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(TINY_ADAPTERS))
def test_merged_tokens_equal_unmerged_and_unmerge_restores_every_param(tiny_device, name):
    device, slot = tiny_device.device, tiny_device.slots[name]
    first, second = _prompts([5, 11])
    before = host_copy(device.params)
    # Unmerged: two rows of the adapter beside a base-model row of the first prompt.
    unmerged = drive(device, [first, second, first], [slot, slot, -1], NEW_TOKENS)
    assert unmerged[0] != unmerged[2], f"{name} changed nothing"

    device.merge(name)
    assert device.merged == name
    assert_only_targets_merged(device, TINY_ADAPTERS[name][1])
    assert drive(device, [first, second], [slot, slot], NEW_TOKENS) == unmerged[:2]

    device.unmerge()
    assert_restored(device, before)
    assert device.memory().merged_weights == 0
    assert drive(device, [first, second, first], [slot, slot, -1], NEW_TOKENS) == unmerged


def test_the_merged_kernels_are_the_base_plus_the_adapters_delta(tiny_device):
    """W' = W + A·B (scaling in B) for every layer of each target, from the host store."""
    device = tiny_device.device
    device.merge("all-r12")
    try:
        for target, (lora_a, lora_b) in device.store.tensors("all-r12").items():
            base = np.asarray(device.base_params["layers"][target]["kernel"])
            merged = device.params["layers"][target]["kernel"]
            assert_close(merged, base + lora_a @ lora_b, np.float32, np.float32, scope="op")
            assert not np.allclose(np.asarray(merged), base)
    finally:
        device.unmerge()


def test_rows_without_an_adapter_run_the_steps_without_lora(tiny_device, monkeypatch):
    """A prefill or decode step whose rows have no adapter runs `base_steps` (no LoRA
    kernel on the step), giving the tokens the same rows get on the LoRA steps beside an
    adapter row; a step with one adapter row runs the LoRA steps; nothing compiles."""
    device, slot = tiny_device.device, tiny_device.slots["all-r4"]
    first, second = _prompts([5, 11], seed=3)
    counts = (device.steps.num_compiles, device.base_steps.num_compiles)
    with_adapter = drive(device, [first, second, first], [-1, -1, slot], NEW_TOKENS)

    def lora_step(*args, **kwargs):
        raise AssertionError("a LoRA step ran for rows without an adapter")

    with monkeypatch.context() as patch:
        for name in ("prefill", "prefill_packed", "decode"):
            patch.setattr(device.steps, name, lora_step)
        alone = drive(device, [first, second], [-1, -1], NEW_TOKENS)
    assert alone == with_adapter[:2]
    assert with_adapter[2] != with_adapter[0]  # the adapter's row did run its LoRA
    assert (device.steps.num_compiles, device.base_steps.num_compiles) == counts


def test_merged_steps_run_no_lora_and_nothing_compiles_after_warmup(
    tiny_device, monkeypatch, tmp_path
):
    """Warm-up compiled the steps without LoRA and one merge per (targets, rank) staged; a
    later adapter's merge compiles when it is staged, off the scheduler thread."""
    device, slot = tiny_device.device, tiny_device.slots["all-r4"]
    assert device.merger.num_compiles == len(TINY_ADAPTERS)  # three distinct shapes
    # prefill 16 and its cached-prefix variant; the packed prefill 16 and 32 (a pack of
    # these prompts fits either); decode 16, 32
    assert device.base_steps.num_compiles == device.steps.num_compiles == 6
    counts = (device.steps.num_compiles, device.base_steps.num_compiles)

    def lora_step(*args, **kwargs):
        raise AssertionError("a LoRA step ran while merged")

    device.merge("all-r4")
    with monkeypatch.context() as patch:
        patch.setattr(device.steps, "prefill", lora_step)
        patch.setattr(device.steps, "decode", lora_step)
        drive(device, _prompts([5, 11]), [slot, slot], NEW_TOKENS)
    device.unmerge()
    assert (device.steps.num_compiles, device.base_steps.num_compiles) == counts

    (path,) = make_demo_adapters(
        device.model_config, tmp_path, n=1, ranks=[6], targets=["down_proj"]
    )
    device.stage_adapter("down-r6", str(path))
    assert device.merger.num_compiles == len(TINY_ADAPTERS) + 1  # at staging
    device.merge("down-r6")
    assert_only_targets_merged(device, ("down_proj",))
    device.unmerge()
    device.drop_adapter("down-r6")
    assert device.merger.num_compiles == len(TINY_ADAPTERS) + 1


def test_rows_of_another_adapter_or_the_base_model_raise_while_merged(tiny_device):
    device, slots = tiny_device.device, tiny_device.slots
    table = np.arange(device.config.blocks_per_seq, dtype=np.int32)
    prompt = _prompts([5])[0]
    device.merge("all-r4")
    try:
        for slot, owner in ((slots["qv-r8"], "'qv-r8'"), (-1, "the base model")):
            with pytest.raises(AssertionError, match=f"slot {slot} \\({owner}\\)"):
                device.prefill(PrefillJob(prompt, table, greedy(0), adapter_slot=slot))
            device.insert(0, DecodeRow(7, 5, table, greedy(1), adapter_slot=slot))
            with pytest.raises(AssertionError, match="a live decode row"):
                device.generate()
            device.free(0)
        with pytest.raises(AssertionError, match="'all-r4' is merged; unmerge first"):
            device.merge("qv-r8")
    finally:
        device.unmerge()
    with pytest.raises(AssertionError, match="no adapter is merged"):
        device.unmerge()
    with pytest.raises(AssertionError, match="no such adapter is staged"):
        device.merge("nope")
    assert device.merged is None


def test_unmerge_restores_bf16_weights_bit_for_bit(tiny, tiny_paths):
    """bf16 kernels: the merged ones are rounded once, and unmerging never subtracts."""
    params = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), tiny.params)
    device = _tiny_engine(tiny, params, dtype="bfloat16")  # merge="never": still offered
    try:
        install(device, {"all-r12": tiny_paths["all-r12"]})
        before = host_copy(device.params)
        assert device.can_merge
        device.merge("all-r12")
        assert_only_targets_merged(device, TARGETS)
        kernel = device.params["layers"]["q_proj"]["kernel"]
        pristine = device.base_params["layers"]["q_proj"]["kernel"]
        assert kernel.dtype == jnp.bfloat16 and not np.array_equal(kernel, pristine)
        device.unmerge()
        assert_restored(device, before)
    finally:
        device.close()


def test_an_engine_without_adapters_cannot_merge(tiny):
    config = EngineConfig(max_slots=1, max_seq_len=32, min_bucket=16)
    device = LlamaEngine(
        model_config=tiny.config, params=tiny.params, tokenizer=None, engine_config=config
    )
    assert not device.can_merge and device.merged is None and device.base_steps is None
    device.close()


# -- the mock engine -------------------------------------------------------------------


def _mock() -> tuple[MockEngine, dict[str, int]]:
    mock = MockEngine(max_slots=3, max_loras=2, merge="auto")
    return mock, install(mock, {"a": mock_adapter_dir(8), "b": mock_adapter_dir(16)})


def test_mock_outputs_are_the_same_merged_or_not():
    mock, slots = _mock()
    assert mock.can_merge and mock.merged is None
    prompts = _prompts([5, 9], seed=3)
    expected = [mock_completion(ids, "a", NEW_TOKENS, mock.vocab_size) for ids in prompts]
    assert drive(mock, prompts, [slots["a"]] * 2, NEW_TOKENS) == expected
    mock.merge("a")
    assert mock.merged == "a"
    assert drive(mock, prompts, [slots["a"]] * 2, NEW_TOKENS) == expected
    mock.unmerge()
    base = mock_completion(prompts[1], None, NEW_TOKENS, mock.vocab_size)
    assert drive(mock, prompts, [slots["a"], -1], NEW_TOKENS) == [expected[0], base]
    assert not MockEngine(max_loras=0).can_merge


def test_mock_raises_on_rows_of_another_adapter_or_the_base_model_while_merged():
    mock, slots = _mock()
    table = np.zeros(8, np.int32)
    mock.merge("a")
    for slot, owner in ((slots["b"], "'b'"), (-1, "the base model")):
        with pytest.raises(AssertionError, match=f"slot {slot} \\({owner}\\)"):
            mock.prefill(PrefillJob([1, 2], table, greedy(0), adapter_slot=slot))
        mock.insert(1, DecodeRow(3, 2, table, greedy(1), adapter_slot=slots["a"]))
        mock.insert(0, DecodeRow(3, 2, table, greedy(1), adapter_slot=slot))
        with pytest.raises(AssertionError, match="a live decode row"):
            mock.generate()
        mock.free(0)
        mock.free(1)
    with pytest.raises(AssertionError, match="unmerge first"):
        mock.merge("b")
    mock.unmerge()
    with pytest.raises(AssertionError, match="no adapter is merged"):
        mock.unmerge()
    with pytest.raises(AssertionError, match="no such adapter is staged"):
        mock.merge("c")


def test_mock_charges_lora_latency_to_unmerged_adapter_rows_only(monkeypatch):
    mock = MockEngine(max_slots=2, max_loras=1, step_latency=0.25, lora_latency=0.5)
    slot = install(mock, {"a": mock_adapter_dir(8)})["a"]
    slept: list[float] = []
    monkeypatch.setattr("jlora.engine.mock.time.sleep", slept.append)
    table = np.zeros(8, np.int32)
    for slots in ([-1], [slot], [slot, -1]):
        for row, adapter_slot in enumerate(slots):
            mock.insert(row, DecodeRow(3, 2, table, greedy(1), adapter_slot=adapter_slot))
        mock.generate()
        for row in range(len(slots)):
            mock.free(row)
    mock.merge("a")
    mock.insert(0, DecodeRow(3, 2, table, greedy(1), adapter_slot=slot))
    mock.generate()
    assert slept == [0.25, 0.75, 0.75, 0.25]  # base only; LoRA; mixed; merged


# -- configuration -------------------------------------------------------------------------


def test_merge_config_is_validated_naming_the_field():
    assert MERGE_MODES == ("never", "auto", "always") and EngineConfig().merge == "never"
    assert EngineConfig(merge="always", max_loras=1).merge == "always"
    with pytest.raises(ConfigError, match=r"EngineConfig.merge='sometimes' must be one of"):
        EngineConfig(merge="sometimes", max_loras=1)
    with pytest.raises(ConfigError, match=r"EngineConfig.merge='auto' needs adapters: max_loras"):
        EngineConfig(merge="auto")


# -- a mesh ---------------------------------------------------------------------------------


def test_a_sharded_merge_equals_the_single_device_one():
    """tp4 on four fake devices (cpu-tiny's two KV heads replicated, so k/v are widened):
    the merged kernels keep the base kernels' specs and equal the single-device ones, the
    tokens merged equal unmerged on both, and unmerging restores every parameter."""
    from tests.test_sharding import run_checks

    case = "merge:cpu-tiny:tp4:follow-base"
    result = run_checks(case, processes=1)[case]
    single, sharded = result["single"], result["sharded"]
    for side in (single, sharded):
        assert side["merged"] == side["unmerged"] != side["base"] and side["restored"]
        assert set(side["specs"]) == set(TARGETS)
        assert all(base == merged for base, merged in side["specs"].values())
    assert sharded["unmerged"] == single["unmerged"]
    assert any("tensor" in base for base, _ in sharded["specs"].values())
    atol, _ = tolerances(np.float32, np.float32, "op")  # one fp32 product per entry
    assert result["max_diff"] <= atol  # measured: 0.0 (the same sums, split by columns)


# -- SmolLM2 with PEFT-made adapters ------------------------------------------------------

PEFT_ADAPTERS = {  # name -> LoraConfig arguments, as tests/test_lora_parity_peft.py
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-r12-rslora": dict(r=12, lora_alpha=8, use_rslora=True, target_modules=list(TARGETS)),
    "mlp-o-r32": dict(
        r=32, lora_alpha=64, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
}
PROMPTS = ["The quick brown fox", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def smol_peft_dirs(smollm2, tmp_path_factory):
    """Adapters written by PEFT for a Llama of SmolLM2's shapes (only the projections
    matter, so the base is materialised uninitialised), lora_A and lora_B drawn at random
    strong enough to change the greedy continuation (PEFT would zero B)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = smollm2.config
    hf_config = LlamaConfig(
        vocab_size=64,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    with torch.device("meta"):
        base = LlamaForCausalLM(hf_config)
    root = tmp_path_factory.mktemp("peft-smol")
    paths = {}
    for seed, (name, kwargs) in enumerate(PEFT_ADAPTERS.items()):
        model = get_peft_model(copy.deepcopy(base), LoraConfig(**kwargs))
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_A" in param_name:  # [r, in]
                    scale = 1 / param.shape[1] ** 0.5
                elif "lora_B" in param_name:  # [out, r]
                    scale = 0.5 / param.shape[1] ** 0.5
                else:
                    continue
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
        model.save_pretrained(str(root / name))
        paths[name] = root / name
    return paths


@pytest.fixture(scope="module")
def smol(smollm2, smol_peft_dirs):
    """One warmed-up SmolLM2 engine with merging on and the three adapters in slots, and
    the base model's greedy tokens of PROMPTS."""
    config = EngineConfig(
        max_slots=2, max_seq_len=32, min_bucket=16, max_loras=3, max_lora_rank=32, merge="auto"
    )
    device = LlamaEngine(
        model_config=smollm2.config, params=smollm2.params, tokenizer=None, engine_config=config
    )
    slots = install(device, smol_peft_dirs)
    prompts = [smollm2.tokenizer.encode(text) for text in PROMPTS]
    assert max(map(len, prompts)) <= 16  # one prefill bucket; 16 more tokens fit in 32
    device.warmup(prompt_lengths=[len(ids) for ids in prompts], max_length=32)
    base = drive(device, prompts, [-1, -1], NEW_TOKENS)
    yield SimpleNamespace(device=device, slots=slots, prompts=prompts, base=base)
    device.close()


def _lora_logits(smollm2, device: LlamaEngine, ids: list[int], slot: int) -> np.ndarray:
    """Unmerged last logits on adapter slot `slot` (tests/model_helpers.py reads the
    model, the weights and the slot through an orchestrator's attributes)."""
    served = SimpleNamespace(
        device=device, adapters=SimpleNamespace(slots=SimpleNamespace(slot_of=lambda _: slot))
    )
    return jlora_last_logits(smollm2, ids, bucket=16, engine=served, adapter="")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PEFT_ADAPTERS))
def test_smollm2_merged_greedy_tokens_and_logits_equal_unmerged(smollm2, smol, name):
    device, slot, prompts = smol.device, smol.slots[name], smol.prompts
    before = host_copy(device.params)
    unmerged = drive(device, prompts, [slot, slot], NEW_TOKENS)
    assert unmerged != smol.base, f"{name} changed nothing"
    logits = [_lora_logits(smollm2, device, ids, slot) for ids in prompts]

    device.merge(name)
    try:
        targets = tuple(t for t in TARGETS if t in PEFT_ADAPTERS[name]["target_modules"])
        assert_only_targets_merged(device, targets)
        assert drive(device, prompts, [slot, slot], NEW_TOKENS) == unmerged
        for ids, expected in zip(prompts, logits, strict=True):
            merged = jlora_last_logits(smollm2, ids, bucket=16, params=device.params)
            assert_close(merged, expected, jnp.float32, np.float32, scope="model")
    finally:
        device.unmerge()
    assert_restored(device, before)
    assert drive(device, prompts, [slot, -1], NEW_TOKENS) == [unmerged[0], smol.base[1]]
