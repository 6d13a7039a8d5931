"""Presets load into validated dataclasses; bad values name their field."""

from __future__ import annotations

import re

import pytest

from configs import ConfigError, EngineConfig, ModelConfig, list_presets, load_preset
from configs.model import RopeScaling

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


HF_BASE = {
    "model_type": "llama",
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize(
    "layout",
    [
        {"rope_parameters": {"rope_theta": 5e5, **LLAMA3_SCALING}},  # transformers 5
        {"rope_theta": 5e5, "rope_scaling": LLAMA3_SCALING},  # Meta's files
    ],
    ids=["rope_parameters", "rope_scaling"],
)
def test_llama3_rope_scaling_is_read_from_both_layouts(layout):
    cfg = ModelConfig.from_hf({**HF_BASE, **layout})
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # as checkpoints store it


def test_linear_rope_scaling_and_the_families():
    linear = ModelConfig.from_hf({**HF_BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == RopeScaling("linear", 2.0)
    qwen = ModelConfig.from_hf({**HF_BASE, "model_type": "qwen2", "use_sliding_window": False,
                                "sliding_window": 8})  # fmt: skip
    assert (qwen.qkv_bias, qwen.o_bias, qwen.mlp_bias, qwen.sliding_window) == (
        True, False, False, None,
    )  # fmt: skip
    mistral = ModelConfig.from_hf({**HF_BASE, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.sliding_window == 4096 and not mistral.qkv_bias
    biased = ModelConfig.from_hf(
        {**HF_BASE, "attention_bias": True, "mlp_bias": True, "head_dim": 6}
    )
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias, biased.q_size) == (True,) * 3 + (12,)
    no_type = {k: v for k, v in HF_BASE.items() if k != "model_type"}
    assert ModelConfig.from_hf({**no_type, "architectures": ["Qwen2ForCausalLM"]}).family == "qwen2"


@pytest.mark.parametrize(
    "change, names",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor=0.5"),
        ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type='gemma'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method='gptq'"),
    ],
)  # fmt: skip
def test_hf_configs_jlora_cannot_serve_are_refused_naming_the_field(change, names):
    with pytest.raises(ConfigError, match=re.escape(names)):
        ModelConfig.from_hf({**HF_BASE, **change})


def test_a_sliding_window_below_the_served_context_is_refused():
    mistral = ModelConfig.from_hf({**HF_BASE, "model_type": "mistral", "sliding_window": 100,
                                   "max_position_embeddings": 4096})  # fmt: skip
    EngineConfig(max_seq_len=96, block_size=16).check_model(mistral)  # within: full attention
    with pytest.raises(ConfigError, match="sliding_window=100 is below .*max_seq_len=128"):
        EngineConfig(max_seq_len=128, block_size=16).check_model(mistral)
