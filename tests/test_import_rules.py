"""The import rules of DESIGN.md and docs/architecture.md, enforced on the source tree and
in a fresh interpreter.

The layers, each importing only those below it: `jlora.contract` (shared with the
router) -> `jlora.engine` (the host side: requests, scheduling, memory bookkeeping) and
`jlora.adapters` (adapters as files and in host memory) -> `jlora.model` (the JAX model,
its LoRA backends, its CPU host kernels) -> `jlora.device` (the JAX device engine) ->
`jlora.server` and `jlora.cli`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["jlora", "pallas_kernels", "cpu_offload", "router", "configs", "bench"]
STDLIB = set(sys.stdlib_module_names)


def _imports(package: str, *, full: bool = False) -> list[tuple[Path, int, str]]:
    """(file, line, module) for every absolute import in a package: the top-level module,
    or with `full` the whole dotted name."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [(path, node.lineno, n if full else n.split(".")[0]) for n in names]
    return found


def _violations(package: str, allowed) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}:{line} imports {module}"
        for p, line, module in _imports(package)
        if not allowed(module)
    ]


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("cpu_offload", {"jax", "jaxlib", "flax", "pallas_kernels", "jlora"}),
        ("router", {"jax", "jaxlib", "flax", "pallas_kernels", "cpu_offload"}),
        ("configs", {"jax", "jaxlib", "flax", "jlora", "router"}),
    ],
)
def test_forbidden_imports(package, forbidden):
    assert _violations(package, lambda m: m not in forbidden) == []


def test_router_and_worker_share_only_the_contract():
    """The router imports from jlora only the API stubs and the contract; the worker never
    imports the router (the CLI, which starts both, may)."""
    shared = ("jlora.api", "jlora.contract")
    router = [
        f"{p.relative_to(ROOT)}:{line} imports {module}"
        for p, line, module in _imports("router", full=True)
        if module.split(".")[0] == "jlora" and not module.startswith(shared)
    ]
    assert router == []
    worker = [
        f"{p.relative_to(ROOT)}:{line} imports {module}"
        for p, line, module in _imports("jlora", full=True)
        if module.split(".")[0] == "router" and "cli" not in p.relative_to(ROOT).parts
    ]
    assert worker == []


def _within(package: str, allowed: tuple[str, ...]) -> list[str]:
    """The absolute imports of project packages in `package` outside `allowed` (prefixes
    of dotted names)."""
    project = ("jlora", "cpu_offload", "pallas_kernels", "router", "bench", "tests")
    return [
        f"{p.relative_to(ROOT)}:{line} imports {module}"
        for p, line, module in _imports(package, full=True)
        if module.split(".")[0] in project and not module.startswith(allowed)
    ]


def test_the_engine_is_the_host_side():
    """jlora.engine imports neither jax nor numba, and from the project only itself, the
    contract and the link throttle: the device engine is an interface to it."""
    heavy = {"jax", "jaxlib", "flax", "numba", "pallas_kernels", "cpu_offload", "torch"}
    assert _violations("jlora/engine", lambda m: m not in heavy) == []
    assert _within("jlora/engine", ("jlora.engine", "jlora.contract", "jlora.link")) == []


def test_the_contract_imports_nothing_of_the_worker():
    """What the router and the worker share imports only itself and the API stubs."""
    assert _within("jlora/contract", ("jlora.contract", "jlora.api")) == []
    assert _violations("jlora/contract", lambda m: m not in {"jax", "numpy", "numba"}) == []


def test_the_client_imports_only_the_api_and_the_contract():
    """jlora.client runs where an application does: of the project, only the stubs and
    the contract (its errors, status details and API key), as the router."""
    assert _within("jlora/client", ("jlora.client", "jlora.api", "jlora.contract")) == []
    assert _violations("jlora/client", lambda m: m not in {"jax", "numpy", "numba"}) == []


def test_the_model_imports_only_the_kernel_helpers_of_cpu_offload():
    """jlora.model knows no engine, server or adapter files: it imports itself, the
    tokenizer it loads, and from cpu_offload only the compiled helpers it shares."""
    allowed = ("jlora.model", "jlora.tokenizer", "cpu_offload.kernels", "pallas_kernels")
    assert _within("jlora/model", allowed) == []


def test_adapters_in_host_memory_need_no_jax():
    assert _violations("jlora/adapters", lambda m: m not in {"jax", "flax", "numba"}) == []
    allowed = ("jlora.adapters", "jlora.contract", "jlora.model.lora.targets")
    assert _within("jlora/adapters", allowed) == []


def test_the_rule_checks_see_the_imports():
    """The layer rules above would pass vacuously if the scanner missed dotted imports."""
    found = {module for _, _, module in _imports("jlora/device", full=True)}
    assert {"jlora.engine.device_api", "jlora.model.llama", "cpu_offload"} <= found
    assert _within("jlora/device", ("jlora.engine",)) != []


def test_pallas_kernels_import_only_jax_and_numpy():
    allowed = STDLIB | {"jax", "jaxlib", "numpy", "pallas_kernels"}
    assert _violations("pallas_kernels", lambda m: m in allowed) == []


def test_nothing_imports_bench_or_tests():
    for package in ["jlora", "pallas_kernels", "cpu_offload", "router", "configs"]:
        assert _violations(package, lambda m: m not in {"bench", "tests"}) == []


def test_the_scanner_sees_imports(tmp_path):
    """The rule checks above would pass vacuously if the scanner found nothing."""
    modules = {module for _, _, module in _imports("jlora")}
    assert {"jax", "flax", "numpy", "configs"} <= modules


@pytest.mark.parametrize(
    "modules, heavy",
    [
        # The light packages and the CLI's entry point.
        ("jlora, jlora.cli.main, jlora.engine.api, configs, router, cpu_offload", "jax flax torch"),
        # A client, or a server test with the mock engine, never pays for jax.
        ("jlora.api, jlora.server, jlora.engine.mock", "jax flax torch"),
        # An application's process: the client (blocking and asyncio).
        ("jlora.client", "jax flax torch numba"),
        # The host side of the engine: scheduling, memory, adapters as files.
        (
            "jlora.engine.orchestrator, jlora.engine.scheduler, jlora.adapters.peft",
            "jax flax numba torch",
        ),
        # The router runs on a small CPU box: gRPC, HTTP and the registry need no jax.
        ("router.app, router.http, jlora.cli.router", "jax flax torch numba"),
        # The contract both sides import: no jax, no numba.
        ("jlora.contract.registry, jlora.contract.status, jlora.contract.auth", "jax numba"),
    ],
)
def test_importing_does_not_load_heavy_modules(modules, heavy):
    """In a fresh interpreter, importing `modules` leaves every one of `heavy` unloaded."""
    code = (
        f"import sys, {modules}; "
        f"heavy = sorted(m for m in {heavy.split()!r} if m in sys.modules); "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_api_stubs_import_only_grpc_and_protobuf():
    allowed = STDLIB | {"grpc", "grpc_tools", "google", "jlora"}
    assert _violations("jlora/api", lambda m: m in allowed) == []
