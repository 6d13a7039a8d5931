"""Tensor parallelism: sharding configs, and the sharded engine on fake CPU devices.

The multi-device checks run in a subprocess with four fake devices
(tests/sharded_checks.py): the sharded engine's greedy tokens equal the single-device
engine's for a mixed batch (base rows, adapters of different ranks and target sets,
loads and evictions during the run) under tp2 and tp4 (whose KV heads are replicated:
cpu-tiny has two), with both LoRA schemes and every backend, and with CPU assistance;
each device holds 1/tp of every split array, and receives only its part of an
adapter's rank-exact transfer; and the compiled decode step has exactly the
collectives each scheme should.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs import (
    ConfigError,
    ShardingConfig,
    list_sharding_presets,
    load_preset,
    load_sharding,
)
from jlora.model.lora.backends import BACKENDS

ROOT = Path(__file__).resolve().parent.parent
FAKE_DEVICES = 4


def fake_devices(count: int) -> str:
    """XLA_FLAGS for a process with `count` fake CPU devices (the session's flags kept)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"


def run_checks(*cases: str, timeout: float = 900, processes: int = 2) -> dict[str, dict]:
    """tests/sharded_checks.py's results, by case, from `processes` processes with fake
    devices side by side (compiling takes one core each). Token cases of one model and
    backend stay in one process, which runs their single-device reference once."""
    env = {
        **os.environ,
        "XLA_FLAGS": fake_devices(FAKE_DEVICES),
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".cache" / "xla-sharded"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    groups: dict[str, list[str]] = {}
    for case in cases:
        kind, model, *args = case.split(":")
        key = f"{model}:{args[2]}" if kind == "tokens" else case  # tokens: model, backend
        groups.setdefault(key, []).append(case)
    shares: list[list[str]] = [[] for _ in range(processes)]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(shares, key=len).extend(group)
    running = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.sharded_checks", *share],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for share in shares
        if share
    ]
    results = {}
    deadline = time.monotonic() + timeout
    for process in running:
        try:
            stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in running:
                other.kill()
            raise
        assert process.returncode == 0, stderr[-4000:]
        for line in stdout.splitlines():
            if line.startswith("{"):
                result = json.loads(line)
                results[result["case"]] = result["result"]
    return results


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
        ("cpu-tiny", "tp8", 4, "needs 8 devices, only 4 are present"),
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

    with pytest.raises(ConfigError, match=r"needs 2 devices, only 1 is present"):
        TensorParallel.build(tiny.config, load_sharding("tp2"))


# -- the sharded engine on fake devices ----------------------------------------------

TOKEN_CASES = [  # model, preset, LoRA scheme, backend, lora_mode
    ("cpu-tiny", "tp2", "follow-base", "reference", "ondemand"),
    ("cpu-tiny", "tp2", "fully-sharded", "reference", "ondemand"),
    ("cpu-tiny", "tp4", "follow-base", "reference", "ondemand"),
    ("cpu-tiny", "tp4", "fully-sharded", "reference", "ondemand"),
    ("cpu-tiny", "tp2", "follow-base", "bgmv", "ondemand"),
    ("cpu-tiny", "tp2", "follow-base", "mbgmv", "ondemand"),
    ("cpu-tiny", "tp2", "fully-sharded", "bgmv", "ondemand"),
    ("cpu-tiny", "tp4", "fully-sharded", "mbgmv", "ondemand"),
    # Three devices: rank rows split in three (max rank 32: 11 each), whole pages.
    ("tiny-x3", "tp3", "fully-sharded", "reference", "ondemand"),
    ("tiny-x3", "tp3", "fully-sharded", "mbgmv", "ondemand"),
    # Llama 3's 8 KV heads (with llama3 RoPE and every bias): 4 per device, then 2.
    ("tiny-gqa8", "tp2", "follow-base", "reference", "ondemand"),
    ("tiny-gqa8", "tp4", "fully-sharded", "reference", "ondemand"),
    ("tiny-gqa8", "tp4", "follow-base", "mbgmv", "ondemand"),
    ("cpu-tiny", "tp2", "follow-base", "reference", "cpu-assist"),
    ("cpu-tiny", "tp4", "fully-sharded", "reference", "cpu-assist"),
]


@pytest.fixture(scope="module")
def tiny_checks():
    cases = [f"tokens:{':'.join(case)}" for case in TOKEN_CASES]
    cases += [
        "memory:cpu-tiny:tp4:follow-base",
        "memory:cpu-tiny:tp4:fully-sharded",
        "hlo:cpu-tiny:tp2:follow-base",
        "hlo:cpu-tiny:tp2:fully-sharded",
    ]
    cases += [f"restore:{':'.join(case)}" for case in RESTORES]
    cases += [f"transfer:cpu-tiny:tp2:{':'.join(case)}" for case in TRANSFER_CASES]
    return run_checks(*cases)


def _assert_equal_tokens(result: dict, mode: str) -> None:
    assert result["sharded"] == result["single"]
    assert result["sharded_evictions"] >= 1 and result["sharded_loads"] >= 3
    if mode == "cpu-assist":
        assert result["sharded_assisted"] >= 1


@pytest.mark.e2e
@pytest.mark.parametrize("case", TOKEN_CASES, ids=["-".join(case) for case in TOKEN_CASES])
def test_sharded_tokens_equal_the_single_device_engines(tiny_checks, case):
    _assert_equal_tokens(tiny_checks[f"tokens:{':'.join(case)}"], case[4])


TRANSFER_CASES = [
    ("fully-sharded", "reference"),
    ("follow-base", "bgmv"),
    ("fully-sharded", "mbgmv"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("case", TRANSFER_CASES, ids=["-".join(case) for case in TRANSFER_CASES])
def test_an_adapter_crosses_to_the_mesh_rank_exact(tiny_checks, case):
    """The rank-12 adapter (bucket 16) of every target, under tp2: the mesh's transfer
    sends what one device's does, each device receives its part alone, and the slots
    installed are the same."""
    result = tiny_checks[f"transfer:cpu-tiny:tp2:{':'.join(case)}"]
    assert result["sharded_bytes"] == result["single_bytes"]
    assert result["equal"]
    whole = {name: shapes[0] for name, shapes in result["single_parts"].items()}
    a_dims = BACKENDS[case[1]].payload_layout["a"]  # A [L, in, Q] or A^T [L, Q, in]
    assert whole["q_proj.a"][a_dims.index("rank")] == 16  # rank 12's bucket

    def split(name: str, dim: int | None) -> list[list[int]]:
        shape = list(whole[name])
        if dim is not None:
            shape[dim] //= 2
        return [shape]

    rank_split = case == ("fully-sharded", "reference")  # stacked slots split A's rank
    expected = {  # q_proj column-parallel, o_proj row-parallel
        "q_proj.a": split("q_proj.a", a_dims.index("rank") if rank_split else None),
        "q_proj.b": split("q_proj.b", 2),
        "o_proj.a": split("o_proj.a", a_dims.index("in")),
        "o_proj.b": split("o_proj.b", 2 if case[0] == "fully-sharded" else None),
    }
    assert result["sharded_parts"] == expected


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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


BIASES = {  # tiny-gqa8's biases -> whether tp4 splits them (a row-parallel one is whole)
    f"['layers']['{name}']['bias']": split
    for name, split in (("q_proj", True), ("k_proj", True), ("v_proj", True),
                        ("gate_proj", True), ("up_proj", True), ("o_proj_bias", False),
                        ("down_proj_bias", False))
}  # fmt: skip
RESTORES = [("cpu-tiny", "tp2", "checkpoint"), ("cpu-tiny", "tp4", "checkpoint"),
            ("cpu-tiny", "tp4", "hf"), ("tiny-gqa8", "tp4", "hf")]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("case", RESTORES, ids=["-".join(case) for case in RESTORES])
def test_weights_load_straight_into_the_mesh(tiny_checks, case):
    """`jlora convert` output read by each device's shards alone, and a Hugging Face
    directory each device of which receives only its shards: the loaded params already
    carry their final split (cpu-tiny's 2 KV heads on tp4 are widened, so k/v come back
    whole and are split when placed; tiny-gqa8's 8 divide), and the engine's tokens are
    right."""
    model, preset, source = case
    result = tiny_checks[f"restore:{':'.join(case)}"]
    assert result["sharded"] == result["single"]
    size = int(preset[2:])
    widened = {"['layers']['k_proj']['kernel']", "['layers']['v_proj']['kernel']"}
    splits = {name: dim is not None for name, dim in SPLIT.items()}
    if model == "tiny-gqa8":
        splits |= BIASES
    assert set(result["layout"]) == set(splits)
    for name, split in splits.items():
        entry = result["layout"][name]
        split = split and not (model == "cpu-tiny" and preset == "tp4" and name in widened)
        share = entry["whole"] // size if split else entry["whole"]
        assert entry["per_device"] == [share] * size, name


@pytest.mark.e2e
@pytest.mark.slow
def test_smollm2_tp3_tokens_equal_the_single_device_engines():
    """SmolLM2 on three devices: 9 heads and 3 KV heads, 3 per device and 1 per device."""
    cases = [
        f"tokens:smollm2-135m:tp3:{scheme}:reference:ondemand"
        for scheme in ("follow-base", "fully-sharded")
    ]
    for result in run_checks(*cases).values():
        _assert_equal_tokens(result, "ondemand")


# -- one worker over two processes ------------------------------------------------------


class ProcessGroup:
    """`jlora serve` as two processes with two fake devices each: one tp4 mesh."""

    def __init__(self, tmp_path: Path, adapters: list[Path], flags: list[str]) -> None:
        import socket

        with socket.socket() as probe:  # the coordinator's port; its followers use + 1
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {
            **os.environ,
            "XLA_FLAGS": fake_devices(2),
            "JAX_PLATFORMS": "cpu",
        }
        self.port_file = tmp_path / "port"
        common = [
            sys.executable, "-m", "jlora.cli.main", "serve", "--model", "cpu-tiny",
            "--sharding", "tp4", "--port", "0", "--max-seq-len", "128", "--max-slots", "4",
            "--max-loras", "2", "--max-lora-rank", "32", "--warmup", "on-demand",
            *(flag for path in adapters for flag in ("--adapter", f"{path.name}={path}")),
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", *flags,
        ]  # fmt: skip
        self.processes = [
            subprocess.Popen(
                [*common, "--process-id", str(index)]
                + (["--port-file", str(self.port_file)] if index == 0 else []),
                cwd=ROOT,
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
            for index in range(2)
        ]
        import time

        deadline = time.monotonic() + 300
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            for process in self.processes:
                assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "the process group did not start"
            time.sleep(0.2)
        self.address = f"127.0.0.1:{self.port_file.read_text().strip()}"

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.mark.e2e
@pytest.mark.serial
def test_a_worker_over_two_processes_serves_behind_the_router(tiny, tmp_path):
    """Two processes, two devices each, one tp4 mesh behind `jlora router`: concurrent
    mixed-adapter streams get the single-device engine's greedy tokens; then a follower
    dies, and the worker reports NOT_SERVING and exits (status 3) instead of hanging."""
    import threading
    import time

    import grpc

    from jlora.api import jlora_pb2 as pb
    from jlora.api import jlora_pb2_grpc as pb_grpc
    from jlora.engine.api import SamplingParams
    from router.app import start_router
    from tests.engine_helpers import make_engine, run_to_completion
    from tests.sharded_checks import _adapters

    paths = {path.name: path for path in _adapters(tiny.config, tmp_path / "adapters").values()}
    names = sorted(paths)
    prompts = [[5, 9, 2, 77], [400, 3, 3, 12, 8], [31, 7], [1, 2, 3, 4, 5, 6], [9, 9, 9]]
    rows = [names[0], None, names[1], names[2], names[0]]
    single = make_engine(
        tiny, max_slots=4, max_seq_len=128, min_bucket=16, max_loras=2, max_lora_rank=32
    )
    for name, path in paths.items():
        single.register_adapter(name, path)
    expected = run_to_completion(
        single, prompts, SamplingParams(max_tokens=8, ignore_eos=True), rows
    )
    single.close()

    group = ProcessGroup(tmp_path, list(paths.values()), [])
    router = start_router([group.address], poll_interval=0.1)
    try:
        got: dict[int, list[int]] = {}

        def call(i: int) -> None:
            with grpc.insecure_channel(router.address) as channel:
                request = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompts[i]),
                    adapter=rows[i] or "",
                    sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True),
                )
                responses = pb_grpc.JloraStub(channel).Generate(request, timeout=120)
                got[i] = [r.token_id for r in responses]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [got[i] for i in range(len(prompts))] == [r["token_ids"] for r in expected]

        leader, follower = group.processes
        follower.kill()
        assert leader.wait(timeout=60) == 3
        deadline = time.monotonic() + 10
        while router.workers[0].up:
            assert time.monotonic() < deadline, "the router kept the lost worker"
            time.sleep(0.05)
    finally:
        router.stop(grace=0)
        group.close()


def test_followers_let_go_of_their_kv_copies_when_the_leader_does():
    """The leader's swap calls, replayed on a follower as they arrive: the follower holds
    its part of every host copy and staged copy the leader holds, and no other."""
    from jlora.device.multiprocess import Leader, _Swaps
    from jlora.engine.mock import MockEngine

    class Connection:  # a follower's end: what the leader sent
        def __init__(self) -> None:
            self.sent: list[tuple[str, tuple]] = []

        def send(self, message: tuple[str, tuple]) -> None:
            self.sent.append(message)

    connection = Connection()
    leader = Leader(MockEngine(), [connection])  # type: ignore[arg-type]
    follower = _Swaps(MockEngine())  # type: ignore[arg-type]

    def held_by_the_follower() -> set[int]:
        for method, args in connection.sent:
            getattr(follower, method)(*args)
        connection.sent.clear()
        return set(follower._copies)

    host = leader.kv_to_host(leader.kv_snapshot([0, 1]))
    staged = leader.kv_to_device(host)
    assert held_by_the_follower() == {host.data.ident, staged.ident}
    leader.kv_restore([2, 3], staged)
    del staged  # restored: the leader lets it go and keeps the host copy
    again = leader.kv_snapshot([1])  # the next call tells the followers
    assert held_by_the_follower() == {host.data.ident, again[0]}
    del host
    last = leader.kv_snapshot([0])
    assert held_by_the_follower() == {again[0], last[0]}
    follower.close()


@pytest.mark.e2e
@pytest.mark.serial
def test_a_worker_over_two_processes_swaps_its_prefix_cache_to_host_memory(tiny, tmp_path):
    """Two processes, one tp4 mesh, a pool of six KV blocks: a second prompt pushes the
    first one's cached blocks out to host memory (each process its devices' part), and
    the first prompt asked again brings them back: all four blocks are reused, and
    every answer has the single-device engine's greedy tokens."""
    import grpc

    from jlora.api import jlora_pb2 as pb
    from jlora.api import jlora_pb2_grpc as pb_grpc
    from jlora.engine.api import SamplingParams
    from tests.engine_helpers import make_engine, run_to_completion

    first, second = list(range(1, 65)), list(range(200, 264))  # four blocks each
    prompts = [first, second, first + [5]]
    single = make_engine(tiny, max_slots=1, max_seq_len=80, min_bucket=16)
    expected = [
        run_to_completion(single, [prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        for prompt in prompts
    ]
    single.close()

    block_bytes = 24576  # cpu-tiny's 3 layers of 16 tokens, its 2 KV heads widened to 4
    group = ProcessGroup(
        tmp_path,
        [],
        ["--max-seq-len", "80", "--max-slots", "1", "--pool-size", str(6 * block_bytes)],
    )
    try:
        with grpc.insecure_channel(group.address) as channel:
            stub = pb_grpc.JloraStub(channel)
            assert (
                stub.Stats(pb.StatsRequest(), timeout=30).memory.kv_bytes_per_block == block_bytes
            )
            answers = []
            for prompt in prompts:
                request = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True),
                )
                responses = list(stub.Generate(request, timeout=120))
                answers.append(([r.token_id for r in responses], responses[-1].usage))
            cache = stub.Stats(pb.StatsRequest(), timeout=30).memory.cache
        assert [tokens for tokens, _ in answers] == [r["token_ids"] for r in expected]
        assert [usage.cached_tokens for _, usage in answers] == [0, 0, 64]
        assert cache.pages_total == 6 and cache.invalid_kv_pages == 0
        assert cache.swaps_out >= 3 and cache.swaps_in >= 3, cache
    finally:
        group.close()
