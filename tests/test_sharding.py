"""Tensor parallelism: sharding configs, and the sharded engine on fake CPU devices.

The multi-device checks run in a subprocess with four fake devices
(tests/sharded_checks.py): the sharded engine's greedy tokens equal the single-device
engine's for a mixed batch (base rows, adapters of different ranks and target sets,
loads and evictions during the run) under tp2 and tp4 (whose KV heads are replicated:
cpu-tiny has two), with both LoRA schemes and every backend, and with CPU assistance;
each device holds 1/tp of every split array; and the compiled decode step has exactly
the collectives each scheme should.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from configs import (
    ConfigError,
    ShardingConfig,
    list_sharding_presets,
    load_preset,
    load_sharding,
)

ROOT = Path(__file__).resolve().parent.parent
FAKE_DEVICES = 4


def run_checks(*cases: str, timeout: float = 900) -> dict[str, dict]:
    """tests/sharded_checks.py's results, by case, from a process with fake devices."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={FAKE_DEVICES}",
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".cache" / "xla-sharded"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.sharded_checks", *cases],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {line["case"]: line["result"] for line in lines}


# -- configs -------------------------------------------------------------------------


def test_presets_load_and_say_what_they_split():
    assert list_sharding_presets() == ["tp1", "tp2", "tp3", "tp4", "tp8"]
    for size in (1, 2, 3, 4, 8):
        config = load_sharding(f"tp{size}")
        assert (config.tensor_axis, config.tensor_parallel) == ("tensor", size)
        assert config.lora_sharding == "follow-base"
        assert {config.axis_of(a) for a in ("vocab", "heads", "kv_heads", "mlp")} == {"tensor"}
        assert config.axis_of("embed") is None and config.axis_of("layers") is None
    assert load_sharding("tp2").with_lora_sharding("fully-sharded").lora_sharding == (
        "fully-sharded"
    )


def test_a_config_file_is_edited_rules(tmp_path):
    path = tmp_path / "mlp-only.yaml"
    path.write_text("mesh: {tensor: 2}\nrules: {mlp: tensor}\n")
    config = load_sharding(path)
    assert config.name == "mlp-only" and config.axis_of("mlp") == "tensor"
    assert config.axis_of("heads") is None and config.axis_of("vocab") is None


@pytest.mark.parametrize(
    "data, names",
    [
        ({"mesh": {"tensor": 2}, "rules": {"embed": "tensor"}}, "rules.embed='tensor'"),
        ({"mesh": {"tensor": 2}, "rules": {"heads": "tensor"}}, "kv_heads=None"),
        ({"mesh": {"tensor": 2}, "rules": {"mlp": "data"}}, "rules.mlp='data' is not a mesh"),
        ({"mesh": {"tensor": 2}, "rules": {"experts": "tensor"}}, "'experts'"),
        ({"mesh": {"tensor": 0}}, "mesh.tensor=0"),
        ({"mesh": {"data": 2, "tensor": 2}, "rules": {"mlp": "tensor"}}, "mesh.data=2"),
        ({"mesh": {"tensor": 2}, "rules": {"mlp": "tensor"}, "lora_sharding": "x"}, "sharding='x'"),
        ({"mesh": {"tensor": 2}, "rules": {}}, "no rule shards anything on 'tensor'"),
        ({"mesh": {"tensor": 2}, "shards": 2}, "unknown field(s) ['shards']"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(data, names):
    with pytest.raises(ConfigError) as caught:
        ShardingConfig.from_dict("bad", data)
    assert names in str(caught.value)


@pytest.mark.parametrize(
    "model, preset, devices, names",
    [
        ("cpu-tiny-tied", "tp2", 8, "num_heads=3, which tensor=2 devices do not divide"),
        ("smollm2-135m", "tp4", 8, "num_heads=9, which tensor=4 devices do not divide"),
        ("cpu-tiny", "tp8", 4, "needs 8 devices, 4 are present"),
        ("llama2-7b", "tp3", 8, "num_heads=32, which tensor=3"),
    ],
)
def test_unsupported_layouts_are_refused_naming_the_sizes(model, preset, devices, names):
    with pytest.raises(ConfigError) as caught:
        load_sharding(preset).check(load_preset(model).config, devices)
    assert names in str(caught.value)


def test_kv_heads_are_divided_or_replicated_never_split_unevenly():
    config = load_preset("cpu-tiny").config  # 4 heads, 2 KV heads
    load_sharding("tp4").check(config, 4)  # 2 KV heads, each on 2 devices
    kv = ShardingConfig.from_dict(
        "kv3", {"mesh": {"tensor": 3}, "rules": {"kv_heads": "tensor", "heads": "tensor"}}
    )
    smol = load_preset("smollm2-135m").config  # 9 heads, 3 KV heads
    kv.check(smol, 3)
    with pytest.raises(ConfigError, match="num_kv_heads=2; tensor=3"):
        kv.check(dataclasses_replace(config, num_heads=6), 3)


def dataclasses_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def test_a_mesh_larger_than_the_devices_present_is_refused_by_the_engine(tiny):
    from jlora.model.sharding import TensorParallel

    with pytest.raises(ConfigError, match=r"needs 2 devices, 1 are present"):
        TensorParallel.build(tiny.config, load_sharding("tp2"))


# -- the sharded engine on fake devices ----------------------------------------------

TOKEN_CASES = [
    ("tp2", "follow-base", "reference", "ondemand"),
    ("tp2", "fully-sharded", "reference", "ondemand"),
    ("tp4", "follow-base", "reference", "ondemand"),
    ("tp4", "fully-sharded", "reference", "ondemand"),
    ("tp2", "follow-base", "bgmv", "ondemand"),
    ("tp2", "follow-base", "mbgmv", "ondemand"),
    ("tp2", "fully-sharded", "bgmv", "ondemand"),
    ("tp4", "fully-sharded", "mbgmv", "ondemand"),
    ("tp2", "follow-base", "reference", "cpu-assist"),
    ("tp4", "fully-sharded", "reference", "cpu-assist"),
]


@pytest.fixture(scope="module")
def tiny_checks():
    cases = [f"tokens:cpu-tiny:{':'.join(case)}" for case in TOKEN_CASES]
    cases += [
        "memory:cpu-tiny:tp4:follow-base",
        "memory:cpu-tiny:tp4:fully-sharded",
        "hlo:cpu-tiny:tp2:follow-base",
        "hlo:cpu-tiny:tp2:fully-sharded",
    ]
    return run_checks(*cases)


def _assert_equal_tokens(result: dict, mode: str) -> None:
    assert result["sharded"] == result["single"]
    assert result["sharded_evictions"] >= 1 and result["sharded_loads"] >= 3
    if mode == "cpu-assist":
        assert result["sharded_assisted"] >= 1


@pytest.mark.parametrize("case", TOKEN_CASES, ids=["-".join(case) for case in TOKEN_CASES])
def test_sharded_tokens_equal_the_single_device_engines(tiny_checks, case):
    _assert_equal_tokens(tiny_checks[f"tokens:cpu-tiny:{':'.join(case)}"], case[3])


SPLIT = {  # parameter -> the dim tp4 splits (None: replicated)
    "['embed']['embedding']": 0,
    "['lm_head']['kernel']": 1,
    "['layers']['q_proj']['kernel']": 2,
    "['layers']['k_proj']['kernel']": 2,
    "['layers']['v_proj']['kernel']": 2,
    "['layers']['o_proj']['kernel']": 1,
    "['layers']['gate_proj']['kernel']": 2,
    "['layers']['up_proj']['kernel']": 2,
    "['layers']['down_proj']['kernel']": 1,
    "['layers']['attn_norm']['scale']": None,
    "['layers']['mlp_norm']['scale']": None,
    "['final_norm']['scale']": None,
}


@pytest.mark.parametrize("scheme", ["follow-base", "fully-sharded"])
def test_each_device_holds_its_share(tiny_checks, scheme):
    result = tiny_checks[f"memory:cpu-tiny:tp4:{scheme}"]
    assert result["devices"] == FAKE_DEVICES
    assert set(result["params"]) == set(SPLIT)
    for name, dim in SPLIT.items():
        entry = result["params"][name]
        share = entry["whole"] // FAKE_DEVICES if dim is not None else entry["whole"]
        assert entry["per_device"] == [share] * FAKE_DEVICES, name
        assert ("'tensor'" in entry["spec"]) == (dim is not None), name
    for entry in result["cache"].values():  # k and v: [L, blocks, bs, kv heads, hd]
        assert entry["spec"] == "P(None, None, None, 'tensor', None)"
        assert entry["per_device"] == [entry["whole"] // FAKE_DEVICES] * FAKE_DEVICES
    for name, entry in result["lora"].items():
        if not name.endswith(("['a']", "['b']")):
            continue  # slot ranks: a few ints, replicated
        split = entry["per_device"] == [entry["whole"] // FAKE_DEVICES] * FAKE_DEVICES
        whole = entry["per_device"] == [entry["whole"]] * FAKE_DEVICES
        if scheme == "fully-sharded":
            assert split, name  # every adapter weight: 1/tp per device
        else:  # follow-base: A of column-parallel and B of row-parallel stay whole
            column = any(t in name for t in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
            expect_split = column == name.endswith("['b']")
            assert split if expect_split else whole, name


def test_follow_base_adds_no_collective_and_fully_sharded_exactly_its_own(tiny_checks):
    follow = tiny_checks["hlo:cpu-tiny:tp2:follow-base"]
    fully = tiny_checks["hlo:cpu-tiny:tp2:fully-sharded"]
    base = follow["base"]
    # The base model: o_proj's and down_proj's all-reduces in the layer scan, one for the
    # vocab-parallel embedding, one all-gather of the logits; nothing else.
    assert base == {
        "all-reduce": 3,
        "all-gather": 1,
        "reduce-scatter": 0,
        "all-to-all": 0,
        "collective-permute": 0,
    }
    assert follow["lora"] == base
    assert fully["base"] == base
    # Per layer: an all-gather of x·A for each of the five column-parallel targets, an
    # all-reduce of x·A for each of the two row-parallel ones.
    assert fully["lora"] == base | {
        "all-gather": base["all-gather"] + 5,
        "all-reduce": base["all-reduce"] + 2,
    }


@pytest.mark.slow
def test_smollm2_tp3_tokens_equal_the_single_device_engines():
    """SmolLM2 on three devices: 9 heads and 3 KV heads, 3 per device and 1 per device."""
    cases = [
        f"tokens:smollm2-135m:tp3:{scheme}:reference:ondemand"
        for scheme in ("follow-base", "fully-sharded")
    ]
    for result in run_checks(*cases).values():
        _assert_equal_tokens(result, "ondemand")
