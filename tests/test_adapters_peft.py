"""PEFT adapter directories (`jlora.adapters.peft`), checked against PEFT itself.

Reading: PEFT builds and saves adapters on a tiny random Llama with cpu-tiny's shapes;
`load_peft_adapter` must give A, B with x @ A[l] @ B[l] equal to PEFT's own LoRA delta,
`lora_B(lora_A(x)) * scaling`, for every target and layer. Writing: PEFT must load
`make_demo_adapters`' directories without missing or unexpected keys, with the same
weights. Every refused adapter names its path and the field or tensor at fault.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from configs import ModelConfig, load_preset
from jlora.adapters.peft import load_peft_adapter, make_demo_adapters, write_peft_adapter
from jlora.cli.main import main
from jlora.contract.adapters import MODULE_OF, Adapter, AdapterError
from jlora.contract.errors import InvalidRequest
from jlora.contract.peft import inspect_adapter, read_adapter_config
from jlora.model.lora.targets import TARGETS, target_shapes
from tests.tolerances import assert_close

TINY = load_preset("cpu-tiny").config


def _hf_tiny():
    """A random transformers Llama with cpu-tiny's shapes (a fresh one: PEFT mutates it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=TINY.hidden_size,
        intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_heads,
        num_key_value_heads=TINY.num_kv_heads,
        max_position_embeddings=TINY.max_context,
    )
    return LlamaForCausalLM(config).eval()


def _peft_layer(peft_model, layer: int, target: str):
    """PEFT's LoRA Linear wrapping projection `target` of decoder layer `layer`."""
    decoder = peft_model.base_model.model.model.layers[layer]
    return getattr(getattr(decoder, MODULE_OF[target]), target)


# -- reading what PEFT wrote -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rank", "alpha", "use_rslora", "target_modules"),
    [
        (1, 2, False, ["q_proj"]),
        (12, 24, True, ["k_proj", "down_proj"]),  # not a power of two; rsLoRA
        (256, 16, False, ["v_proj"]),  # rank above in (64) and out (32)
        (8, 16, True, list(TARGETS)),
        (4, 6, False, ["self_attn.o_proj", "mlp.up_proj", "gate_proj"]),  # dotted suffixes
    ],
    ids=["r1", "r12-rslora", "r256", "r8-all-rslora", "r4-dotted"],
)
def test_peft_saved_adapter_matches_peft_delta(tmp_path, rank, alpha, use_rslora, target_modules):
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        _hf_tiny(),
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, use_rslora=use_rslora),
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT initialises B to zero: the delta would be 0
                param.normal_(0.0, 0.5)
    peft_model.save_pretrained(tmp_path)

    adapter = load_peft_adapter(tmp_path, TINY)

    expected_targets = tuple(t for t in TARGETS if any(m.endswith(t) for m in target_modules))
    assert adapter.adapter.targets == expected_targets
    assert set(adapter.weights) == set(expected_targets)
    assert adapter.num_layers == TINY.num_layers
    assert adapter.adapter.size_bytes == (tmp_path / "adapter_model.safetensors").stat().st_size
    shapes = target_shapes(TINY)
    x = torch.randn(
        5, max(shapes[t][0] for t in TARGETS), generator=torch.Generator().manual_seed(2)
    )
    for target in expected_targets:
        in_features, out_features = shapes[target]
        lora_a, lora_b = adapter.weights[target]
        assert lora_a.dtype == np.float32 and lora_b.dtype == np.float32
        assert lora_a.shape == (TINY.num_layers, in_features, rank)
        assert lora_b.shape == (TINY.num_layers, rank, out_features)
        for layer in range(TINY.num_layers):
            module = _peft_layer(peft_model, layer, target)
            assert module.scaling["default"] == pytest.approx(adapter.adapter.scaling, rel=1e-12)
            rows = x[:, :in_features]
            with torch.no_grad():
                peft_delta = (
                    module.lora_B["default"](module.lora_A["default"](rows))
                    * module.scaling["default"]
                )
            ours = rows.numpy() @ lora_a[layer] @ lora_b[layer]
            assert ours.dtype == np.float32
            # Relative to the largest entry (entries near zero keep no relative
            # precision); measured: at most 3.3e-7 of it over these cases.
            scale = np.abs(peft_delta.numpy()).max()
            assert_close(
                ours / scale, peft_delta.numpy() / scale, np.float32, np.float32, scope="op"
            )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_tensors_are_widened_exactly(tmp_path, dtype):
    import torch
    from safetensors.torch import load_file, save_file

    (path,) = make_demo_adapters(TINY, tmp_path, n=1, ranks=[4], targets=["q_proj"])
    file = path / "adapter_model.safetensors"
    halves = {k: v.to(getattr(torch, dtype)) for k, v in load_file(file).items()}
    save_file(halves, file, metadata={"format": "pt"})

    adapter = load_peft_adapter(path, TINY)

    key = "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"
    np.testing.assert_array_equal(adapter.weights["q_proj"][0][2], halves[key].float().numpy().T)


# -- PEFT reading what we wrote --------------------------------------------------------


@pytest.mark.slow
def test_peft_loads_demo_adapters_with_the_same_weights(tmp_path):
    from peft import PeftModel

    paths = make_demo_adapters(TINY, tmp_path, n=2, ranks=[4, 12], seed=3)

    for path in paths:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            peft_model = PeftModel.from_pretrained(_hf_tiny(), path)
        assert not [w for w in caught if "adapter keys" in str(w.message)]
        result = peft_model.load_adapter(path, adapter_name="again")
        assert result.unexpected_keys == []
        assert [k for k in result.missing_keys if ".again." in k] == []

        ours = load_peft_adapter(path, TINY)
        assert ours.adapter.alpha == 2 * ours.adapter.rank and ours.adapter.scaling == 2.0
        for target in TARGETS:
            lora_a, lora_b = ours.weights[target]
            assert np.all(lora_a != 0) and np.all(lora_b != 0)  # PEFT's B would be zero
            for layer in range(TINY.num_layers):
                module = _peft_layer(peft_model, layer, target)
                assert module.r["default"] == ours.adapter.rank
                assert module.scaling["default"] == ours.adapter.scaling
                peft_a = module.lora_A["default"].weight.detach().numpy()
                peft_b = module.lora_B["default"].weight.detach().numpy()
                np.testing.assert_array_equal(lora_a[layer], peft_a.T)
                # scaling 2 is a power of two: folding it into B is exact
                np.testing.assert_array_equal(lora_b[layer], peft_b.T * module.scaling["default"])


def test_demo_adapters_are_deterministic_and_independent_of_n(tmp_path):
    first = make_demo_adapters(TINY, tmp_path / "a", n=3, ranks=[4, 8], seed=5)
    again = make_demo_adapters(TINY, tmp_path / "b", n=1, ranks=[4, 8], seed=5)
    other = make_demo_adapters(TINY, tmp_path / "c", n=1, ranks=[4, 8], seed=6)

    assert [p.name for p in first] == ["demo-00-r4", "demo-01-r8", "demo-02-r4"]
    digest = [inspect_adapter(p)[0].sha256 for p in (*first, *again, *other)]
    assert digest[0] == digest[3]  # same seed, same index
    assert digest[0] != digest[2]  # same rank, another index
    assert digest[0] != digest[4]  # another seed


def test_demo_adapter_refuses_to_overwrite(tmp_path):
    make_demo_adapters(TINY, tmp_path, n=1, ranks=[4])
    (tmp_path / "demo-01-r8").mkdir()  # empty: allowed
    sha = inspect_adapter(tmp_path / "demo-00-r4")[0].sha256

    with pytest.raises(AdapterError, match="demo-00-r4 exists"):
        make_demo_adapters(TINY, tmp_path, n=2, ranks=[4, 8], seed=1)
    assert inspect_adapter(tmp_path / "demo-00-r4")[0].sha256 == sha
    assert not any((tmp_path / "demo-01-r8").iterdir())  # nothing written before the refusal


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(n=0, ranks=[4]), "n=0"),
        (dict(n=1, ranks=[]), "ranks"),
        (dict(n=1, ranks=[4, 0]), "rank=0"),
        (dict(n=1, ranks=[4], targets=["q_proj", "lm_head"]), "'lm_head'"),
        (dict(n=1, ranks=[4], targets=[]), "no target modules"),
        (dict(n=1, ranks=[4], seed=-1), "seed=-1"),
    ],
)
def test_demo_arguments_are_validated(tmp_path, kwargs, fragment):
    with pytest.raises(AdapterError, match=fragment):
        make_demo_adapters(TINY, tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())


# -- adapter_config.json ---------------------------------------------------------------


def _write_config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config | fields))
    return path


@pytest.mark.parametrize(
    ("fields", "targets", "scaling"),
    [
        ({}, ("q_proj",), 2.0),  # 32 / 16
        ({"use_rslora": True}, ("q_proj",), 8.0),  # 32 / sqrt(16)
        ({"target_modules": "all-linear", "lora_alpha": 8.0}, TARGETS, 0.5),
        (
            {"target_modules": ["mlp.down_proj", "v_proj", "self_attn.v_proj"]},
            ("v_proj", "down_proj"),
            2.0,
        ),
    ],
)
def test_read_adapter_config(tmp_path, fields, targets, scaling):
    spec = read_adapter_config(_write_config(tmp_path, base_model_name_or_path="base", **fields))

    assert spec.targets == targets
    assert spec.scaling == scaling
    assert (spec.rank, spec.base_model) == (16, "base")


def test_inspect_refuses_a_file_without_lora_tensors(tmp_path):
    from safetensors.numpy import save_file

    path = _write_config(tmp_path / "adapter")
    save_file({"lm_head.weight": np.ones((2, 2), np.float32)}, path / "adapter_model.safetensors")

    with pytest.raises(AdapterError, match="no lora_A/lora_B tensors"):
        inspect_adapter(path)


def _rank4(target: str, layers: int = 3) -> tuple[np.ndarray, np.ndarray]:
    in_features, out_features = target_shapes(TINY)[target]
    return np.ones((layers, 4, in_features)), np.ones((layers, out_features, 4))


@pytest.mark.parametrize(
    ("weights", "fragment"),
    [
        ({"q_proj": _rank4("q_proj")}, "do not match the spec's targets"),
        (
            {"q_proj": _rank4("q_proj"), "v_proj": (np.ones((4, 64)), np.ones((32, 4)))},
            "[L, rank, in]",
        ),
        ({"q_proj": _rank4("q_proj"), "v_proj": _rank4("v_proj", 2)}, "layer counts [2, 3]"),
        ({"q_proj": _rank4("q_proj"), "v_proj": (np.ones((3, 8, 64)),) * 2}, "rank 4"),
    ],
    ids=["targets", "ndim", "layers", "rank"],
)
def test_writer_checks_its_arguments(tmp_path, weights, fragment):
    spec = Adapter(rank=4, alpha=8, targets=("v_proj", "q_proj"))
    with pytest.raises(AdapterError) as raised:
        write_peft_adapter(tmp_path / "adapter", spec, weights)
    assert fragment in str(raised.value)
    assert not (tmp_path / "adapter").exists()


def test_the_adapter_record_validates_and_normalises():
    spec = Adapter(rank=4, alpha=8, targets=["self_attn.v_proj", "q_proj"])
    assert spec.targets == ("q_proj", "v_proj") and spec.alpha == 8.0 and spec.scaling == 2.0
    assert Adapter(rank=4, alpha=8, targets=("q_proj",), use_rslora=True).scaling == 4.0
    for fields, field in [
        ({"rank": 0}, "rank"),
        ({"rank": True}, "rank"),
        ({"alpha": float("nan")}, "alpha"),
        ({"targets": ("lm_head",)}, "targets"),
        ({"targets": "q_proj"}, "targets"),
        ({"use_rslora": "yes"}, "use_rslora"),
    ]:
        with pytest.raises(InvalidRequest) as raised:
            Adapter(**{"rank": 4, "alpha": 8.0, "targets": ("q_proj",)} | fields)
        assert raised.value.field == field and raised.value.message.startswith(f"{field}=")


# -- refused adapters ------------------------------------------------------------------


def _good_adapter(path: Path, config: ModelConfig = TINY) -> Path:
    """A valid rank-4 adapter on q_proj and v_proj, written by our writer."""
    rng = np.random.default_rng(0)
    weights = {
        target: (
            rng.normal(size=(config.num_layers, 4, in_features)),
            rng.normal(size=(config.num_layers, out_features, 4)),
        )
        for target, (in_features, out_features) in target_shapes(config).items()
        if target in ("q_proj", "v_proj")
    }
    return write_peft_adapter(
        path, Adapter(rank=4, alpha=8.0, targets=("q_proj", "v_proj")), weights
    )


def _edit_config(**fields):
    def edit(path: Path) -> None:
        file = path / "adapter_config.json"
        file.write_text(json.dumps(json.loads(file.read_text()) | fields))

    return edit


def _edit_tensors(edit_dict):
    def edit(path: Path) -> None:
        from safetensors.numpy import load_file, save_file

        file = path / "adapter_model.safetensors"
        tensors = load_file(file)
        edit_dict(tensors)
        save_file(tensors, file)

    return edit


def _made_for_a_wider_model(path: Path) -> None:
    """Replace the adapter with one for a model of hidden size 128 (cpu-tiny: 64)."""
    shutil.rmtree(path)
    wide = dataclasses.replace(TINY, name="wide", hidden_size=128)
    _good_adapter(path, wide)


def _replace_weights_file(path: Path, data: bytes) -> None:
    (path / "adapter_model.safetensors").write_bytes(data)


def _truncate_weights_file(path: Path) -> None:
    _replace_weights_file(path, (path / "adapter_model.safetensors").read_bytes()[:-10])


def _keep_only_a_bin_file(path: Path) -> None:
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")


def _write_config_text(text: str):
    return lambda path: (path / "adapter_config.json").write_text(text)


def _unlink(name: str):
    return lambda path: (path / name).unlink()


Q_A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
V_B1 = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
DORA_MAGNITUDE = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
LM_HEAD_A = "base_model.model.lm_head.lora_A.weight"

# case -> (edit of a valid adapter directory, fragments the error message must contain)
BAD_ADAPTERS = {
    "missing-directory": (shutil.rmtree, ["does not exist"]),
    "missing-config": (_unlink("adapter_config.json"), ["adapter_config.json is missing"]),
    "malformed-json": (_write_config_text("{r: 4"), ["adapter_config.json", "JSON"]),
    "not-an-object": (_write_config_text("[4]"), ["adapter_config.json", "JSON object"]),
    "peft-type": (_edit_config(peft_type="LOHA"), ['peft_type="LOHA"']),
    "dora": (_edit_config(use_dora=True), ["use_dora=true", "DoRA"]),
    "modules-to-save": (_edit_config(modules_to_save=["lm_head"]), ["modules_to_save"]),
    "bias": (_edit_config(bias="all"), ['bias="all"']),
    "rank-pattern": (_edit_config(rank_pattern={"q_proj": 8}), ["rank_pattern"]),
    "fan-in-fan-out": (_edit_config(fan_in_fan_out=True), ["fan_in_fan_out=true"]),
    "layers-to-transform": (_edit_config(layers_to_transform=[0]), ["layers_to_transform"]),
    "rank-zero": (_edit_config(r=0), ["r=0"]),
    "alpha-string": (_edit_config(lora_alpha="8"), ['lora_alpha="8"']),
    "lm-head-target": (
        _edit_config(target_modules=["q_proj", "lm_head"]),
        ["target_modules", "lm_head"],
    ),
    "regex-target": (
        _edit_config(target_modules=".*q_proj"),
        ["target_modules", "regular expressions"],
    ),
    "missing-weights": (
        _unlink("adapter_model.safetensors"),
        ["adapter_model.safetensors is missing"],
    ),
    "bin-only": (_keep_only_a_bin_file, ["adapter_model.bin", "pickle", "safetensors"]),
    "truncated": (_truncate_weights_file, ["adapter_model.safetensors", "cannot read"]),
    "random-bytes": (
        lambda path: _replace_weights_file(path, np.random.default_rng(0).bytes(4096)),
        ["adapter_model.safetensors", "cannot read"],
    ),
    "missing-tensor": (_edit_tensors(lambda t: t.pop(V_B1)), [f"tensor {V_B1} is missing"]),
    "dora-magnitude": (
        _edit_tensors(lambda t: t.update({DORA_MAGNITUDE: np.ones(64, np.float32)})),
        [f"unexpected tensor {DORA_MAGNITUDE}"],
    ),
    "lm-head-tensor": (
        _edit_tensors(lambda t: t.update({LM_HEAD_A: np.ones((4, 64), np.float32)})),
        [f"unexpected tensor {LM_HEAD_A}"],
    ),
    "extra-layer": (
        _edit_tensors(lambda t: t.update({Q_A0.replace("layers.0", "layers.3"): t[Q_A0]})),
        ["unexpected tensor base_model.model.model.layers.3.", "different base model"],
    ),
    "wrong-shape": (
        _made_for_a_wider_model,
        [f"tensor {Q_A0} has shape (4, 128), expected (4, 64)", "different base model"],
    ),
    "wrong-rank": (
        _edit_config(r=8),
        [f"tensor {Q_A0} has shape (4, 64), expected (8, 64)", "r=8"],
    ),
    "int-dtype": (
        _edit_tensors(lambda t: t.update({Q_A0: t[Q_A0].astype(np.int32)})),
        [f"tensor {Q_A0} has dtype I32"],
    ),
    "nan": (
        _edit_tensors(lambda t: t[V_B1].__setitem__((0, 0), np.nan)),
        [f"tensor {V_B1} has non-finite values"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_bad_adapter_is_refused_naming_the_field(tmp_path, case):
    edit, fragments = BAD_ADAPTERS[case]
    path = _good_adapter(tmp_path / "adapter")
    load_peft_adapter(path, TINY)  # valid before the edit
    edit(path)

    with pytest.raises(AdapterError) as raised:
        load_peft_adapter(path, TINY)

    message = str(raised.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message


# -- the CLI ---------------------------------------------------------------------------


@pytest.fixture
def no_xla_cache(monkeypatch):
    """`main` would point jax's compilation cache at ~/.cache; these commands need none."""
    monkeypatch.setenv("JLORA_COMPILATION_CACHE", "")


def test_cli_make_demo_and_inspect(tmp_path, capsys, no_xla_cache):
    out = tmp_path / "demos"
    argv = ["adapters", "make-demo", "--out", str(out), "--n", "3", "--ranks", "4,8"]
    assert main([*argv, "--targets", "v_proj,self_attn.q_proj", "--model", "cpu-tiny"]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(out / name) for name in ("demo-00-r4", "demo-01-r8", "demo-02-r4")]

    adapter = out / "demo-01-r8"
    sha256 = hashlib.sha256((adapter / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert main(["adapters", "inspect", str(adapter)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for line in [
        "rank: 8",
        "alpha: 16.0",
        "scaling: 2.0",
        "targets: q_proj,v_proj",
        "base_model: cpu-tiny",
        f"num_layers: {TINY.num_layers}",
        f"sha256: {sha256}",
    ]:
        assert line in lines

    assert main(["adapters", "inspect", str(adapter), "--model", "cpu-tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["sha256"] == sha256 and info["compatible_with"] == "cpu-tiny"
    assert info["size_bytes"] == (adapter / "adapter_model.safetensors").stat().st_size
    assert main(["adapters", "inspect", str(adapter), "--model", "cpu-tiny"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "compatible with cpu-tiny"


@pytest.mark.parametrize(
    ("flag", "value", "fragment"),
    [
        ("--ranks", "8,x", "comma-separated list of integers"),
        ("--ranks", "8,0", "rank=0"),
        ("--targets", "q_proj,lm_head", "'lm_head'"),
    ],
)
def test_cli_make_demo_bad_flag_exits_2_naming_it(tmp_path, capsys, flag, value, fragment):
    argv = ["adapters", "make-demo", "--out", str(tmp_path), "--n", "2", "--ranks", "8"]
    with pytest.raises(SystemExit) as raised:
        main([*argv, flag, value])

    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and fragment in err
    assert not any(tmp_path.iterdir())


def test_cli_inspect_corrupt_adapter_exits_2(tmp_path, capsys, no_xla_cache):
    path = _good_adapter(tmp_path / "adapter")
    _replace_weights_file(path, b"not safetensors")

    assert main(["adapters", "inspect", str(path)]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("jlora: error: ")
    assert "adapter_model.safetensors" in captured.err


# -- SmolLM2 ---------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_adapter_changes_smollm2_greedy_tokens(tmp_path, hf_smollm2, smollm2_gguf_path):
    """PEFT with demo-00-r8 on transformers' SmolLM2 continues a prompt differently from
    the base model, without degenerating into one repeated token."""
    import torch
    from peft import PeftModel

    from jlora.model.gguf import GGUFFile
    from jlora.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_fields(GGUFFile(smollm2_gguf_path).fields)
    ids = torch.tensor([tokenizer.encode("Once upon a time, there was a")])
    (path,) = make_demo_adapters(load_preset("smollm2-135m").config, tmp_path, n=1, ranks=[8])

    def greedy(model) -> list[int]:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        return out[0, ids.shape[1] :].tolist()

    base = greedy(hf_smollm2)
    adapted = greedy(PeftModel.from_pretrained(copy.deepcopy(hf_smollm2), path).eval())

    assert adapted != base, tokenizer.decode(adapted)
    assert len(set(adapted)) > len(adapted) // 2, tokenizer.decode(adapted)
