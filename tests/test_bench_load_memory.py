"""bench/load_memory.py: the checkpoint it writes is one transformers reads as written
and jlora serves in bf16, and a measurement reads the child's resident set."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.load_memory import Plan, measure, write_checkpoint

TINY = dataclasses.replace(
    Plan(), vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, tie_embeddings=False, shard_mb=0.1,
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("load-memory")
    total = write_checkpoint(TINY, path)
    return path, total


def test_the_checkpoint_is_sharded_and_transformers_reads_it_as_jlora_does(checkpoint):
    import jax.numpy as jnp
    import torch
    import transformers

    from jlora.model.loading import load_model

    path, total = checkpoint
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ours = load_model(str(path), jnp.bfloat16)
    assert sum(p.numel() * 2 for p in theirs.parameters()) == total
    assert ours.config.rope_scaling is not None and ours.config.rope_scaling.type == "llama3"
    for i in range(TINY.num_layers):
        expected = theirs.model.layers[i].mlp.down_proj.weight.detach().float().numpy().T
        got = np.asarray(ours.params["layers"]["down_proj"]["kernel"][i]).astype(np.float32)
        np.testing.assert_array_equal(got, expected)


def test_a_measurement_reads_the_childs_resident_set(checkpoint):
    path, total = checkpoint
    result = measure(path)
    assert result["dtypes"] == ["bfloat16"] and result["weights_bytes"] == total
    assert 0 < result["baseline_kb"] <= result["peak_kb"]
    assert result["ratio"] == pytest.approx(result["rise_bytes"] / total)
