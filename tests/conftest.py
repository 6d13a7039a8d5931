"""Shared fixtures: the real SmolLM2 (loaded once), its PyTorch oracle, tiny models."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import pytest

# A cold run (CI's: a fresh clone) spends about half its time compiling. XLA:CPU at
# LLVM's -O0 compiles about a fifth faster, and the steps of the models under test run
# nearly as fast (tests/test_parity_hf.py and test_cpu_assist.py cold: 154 s at the
# default, 123 s at -O0). Set before jax starts its backend, so the tests' own processes
# inherit it too (test_sharding's `fake_devices` adds to it rather than replacing it).
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_TEST_FLAGS}".strip()

# Many tests build engines for the same model and buckets: XLA's persistent cache turns
# every compilation after the first into a load from disk (tracing still happens, so the
# compilation-count test sees a missing warm-up). Local to the checkout.
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get(
        "JLORA_TEST_XLA_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "xla")
    ),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture(scope="session")
def smollm2():
    """The default model as the CLI loads it: LoadedModel(config, params, tokenizer, source)."""
    from jlora.model.loading import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    from configs import load_preset

    return load_preset("smollm2-135m").weights.resolve_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    """transformers' own loading of the same GGUF file (fp32), the correctness oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def tiny():
    """cpu-tiny: random weights, GQA, untied embeddings, no tokenizer."""
    from jlora.model.loading import load_model

    return load_model("cpu-tiny")
