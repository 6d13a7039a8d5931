"""Presets load into validated dataclasses; bad values name their field."""

from __future__ import annotations

import pytest

from configs import ConfigError, EngineConfig, ModelConfig, list_presets, load_preset

BASE = dict(
    name="t",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
)


def test_presets_named_in_the_design_exist():
    assert {"smollm2-135m", "llama2-7b", "llama2-13b", "llama2-70b", "cpu-tiny"} <= set(
        list_presets()
    )


@pytest.mark.parametrize(
    "name, params_billions", [("llama2-7b", 6.74), ("llama2-13b", 13.0), ("llama2-70b", 69.0)]
)
def test_llama2_presets_have_the_real_sizes(name, params_billions):
    """The model's own parameter tree (shapes only, nothing allocated) has the paper sizes."""
    import jax
    import numpy as np

    from jlora.model.llama import Llama

    shapes = Llama(load_preset(name).config).param_shapes()
    total = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
    assert total / 1e9 == pytest.approx(params_billions, rel=0.01)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="unknown model preset 'nope'; presets: .*smollm2-135m"):
        load_preset("nope")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 0}, "ModelConfig.hidden_size=0"),
        ({"num_heads": 3}, "hidden_size=8 is not divisible by num_heads=3"),
        ({"num_kv_heads": 3, "num_heads": 2}, "num_heads=2 must be a multiple of num_kv_heads=3"),
        ({"rope_theta": -1.0}, "rope_theta=-1.0"),
        ({"head_dim": 3}, "head_dim=3 must be even"),
        ({"rms_norm_eps": 2.0}, "rms_norm_eps=2.0"),
    ],
)
def test_model_config_names_the_bad_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**BASE, **change})


def test_model_config_refuses_unknown_fields():
    with pytest.raises(ConfigError, match=r"unknown ModelConfig field\(s\) \['layers'\]"):
        ModelConfig.from_dict({**BASE, "layers": 3})


def test_hf_config_round_trip():
    hf = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_theta": 5e5,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    }
    cfg = ModelConfig.from_hf(hf, "m")
    assert (cfg.head_dim, cfg.rope_theta, cfg.max_context, cfg.tie_embeddings) == (
        4,
        5e5,
        128,
        True,
    )


def test_engine_config_buckets_default_to_powers_of_two():
    cfg = EngineConfig(max_seq_len=200, block_size=8, min_bucket=16)
    assert cfg.prefill_buckets == (16, 32, 64, 128, 200)
    assert cfg.num_blocks == 8 * 200 // 8


@pytest.mark.parametrize(
    "slots, rows", [(1, (1,)), (8, (8,)), (31, (31,)), (32, (8, 32)), (128, (8, 32, 128))]
)
def test_decode_row_buckets_default_to_quarters_of_max_slots_down_to_eight(slots, rows):
    assert EngineConfig(max_slots=slots).decode_row_buckets == rows
    assert EngineConfig(max_slots=slots, decode_row_buckets=(slots, 1)).decode_row_buckets == (
        1,
        slots,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dtype": "float16"}, "EngineConfig.dtype='float16'"),
        ({"max_slots": 0}, "EngineConfig.max_slots=0"),
        ({"max_seq_len": 100}, "max_seq_len=100 must be a multiple of block_size=16"),
        ({"prefill_buckets": (16, 64)}, "prefill_buckets=.* must be positive and end at"),
        ({"decode_buckets": (20, 2048)}, "decode_buckets has 20, not a multiple of block_size"),
        ({"decode_row_buckets": (2, 4)}, r"decode_row_buckets=\(2, 4\) must .* end at max_slots=8"),
        ({"decode_row_buckets": (0, 8)}, "decode_row_buckets=.* must be positive"),
        ({"cpu_lora": "fibers"}, r"EngineConfig.cpu_lora='fibers' must be one of \('auto'"),
        ({"lora_pool": "heap"}, r"EngineConfig.lora_pool='heap' must be one of \('kv'"),
        ({"layer_loop": "rolled"}, r"EngineConfig.layer_loop='rolled' must be one of \('auto'"),
    ],
)
def test_engine_config_names_the_bad_field(change, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**change)


def test_hf_config_with_scaled_rope_is_refused():
    hf = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0},
    }
    with pytest.raises(ConfigError, match="rope_type='llama3' is not supported"):
        ModelConfig.from_hf(hf)
