"""Shared fixtures: the real SmolLM2 (loaded once), its PyTorch oracle, tiny models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jaxlib.version
import pytest

# A cold run (CI's: a fresh clone) spends about half its time compiling. XLA:CPU at
# LLVM's -O0 compiles about a fifth faster, and the steps of the models under test run
# nearly as fast (tests/test_parity_hf.py and test_cpu_assist.py cold: 154 s at the
# default, 123 s at -O0). XLA:CPU's older fusion emitters compile faster again at the
# same step speed (SmolLM2's 20-step warm-up: 18.0 s in XLA's compiler, 6.7 s with
# them; the whole cold run 27 min -> 22 min on 2 cores). The product compiles with the
# default emitters, and a test that compares two different programs bit for bit checks
# how XLA fuses them, so such a test is marked `product_codegen` and runs in a process
# of its own with the default emitters (`pytest_pyfunc_call` below). Set before jax
# starts its backend, so the tests' own processes inherit them too (test_sharding's
# `fake_devices` adds to them rather than replacing them). XLA aborts the process on a
# flag it does not know, and the older emitters and their flag are gone from jaxlib 0.11
# (0.11.2, the GPU image's, has neither): there every test runs the product's emitters.
PRODUCT_CODEGEN = os.environ.get("JLORA_TEST_CODEGEN") == "product"
OLDER_EMITTERS = jaxlib.version.__version_info__ < (0, 11)
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false" if OLDER_EMITTERS and not PRODUCT_CODEGEN else ""
)
# The flags this run was given, before the first conftest added the tests' (pytest-xdist's
# workers inherit both: they add theirs to the given flags, not to the controller's).
GIVEN_XLA_FLAGS = os.environ.setdefault("JLORA_GIVEN_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{GIVEN_XLA_FLAGS} {XLA_TEST_FLAGS}".strip()

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


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A `product_codegen` test runs in a pytest process of its own with the product's
    XLA:CPU emitters (this process's fixtures are set up for nothing), unless this is
    that process."""
    if PRODUCT_CODEGEN or pyfuncitem.get_closest_marker("product_codegen") is None:
        return None
    env = {**os.environ, "XLA_FLAGS": GIVEN_XLA_FLAGS, "JLORA_TEST_CODEGEN": "product"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
        cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert child.returncode == 0, f"{pyfuncitem.nodeid} with the product's emitters:\n" + (
        child.stdout[-6000:] + child.stderr[-2000:]
    )
    return True


def _torch_on_one_thread() -> None:
    """In an xdist worker, torch's operations (the oracles: transformers, PEFT) run on one
    thread. Its two OpenMP threads spin waiting for each other while the other worker
    holds a core: the greedy HF parity test took 94 s in a cold `make test` and 12 s
    alone. Beside each other, five oracle-heavy files under `-n 2` took 149 and 136 s
    with two threads, 127 and 127 s with one (2026-11-29). Torch alone: setting
    OMP_NUM_THREADS=1 for the whole worker slowed the mix (df5c93c)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _torch_on_one_thread()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    _torch_on_one_thread()  # again: the test's fixtures may have imported torch


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
    """transformers' own loading of the same GGUF file (fp32), the correctness oracle
    (converted once a machine: `bench.baselines.hf_model`)."""
    import torch

    from bench.baselines import hf_model

    torch.manual_seed(0)
    return hf_model.model(smollm2_gguf_path)


@pytest.fixture(scope="session")
def tiny():
    """cpu-tiny: random weights, GQA, untied embeddings, no tokenizer."""
    from jlora.model.loading import load_model

    return load_model("cpu-tiny")
