"""Workers that come back, die with their parent, and stay up while busy (issue 18: 7, 8).

- Supervision (jlora/cli/supervisor.py), with real processes: a worker SIGKILLed under
  `jlora up` is restarted on its port and serves again through the router with its
  adapters, the one registered at run time included; a SIGKILLed `jlora up` leaves no
  process, listener, shared-memory segment or temporary file behind. The backoff and
  the parent-death signal (jlora/contract/lifetime.py), on small stand-in processes.
- Health with hysteresis (router/workers.py): a worker whose probes time out once or
  twice stays up, three times is marked down (and comes back), one too busy for a Stats
  snapshot stays up; a worker tokenizing a long prompt or stepping a long prefill still
  answers its health probe within the router's probe timeout (measured).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.lib.processes import ROOT, ServerProcess
from bench.lib.processes import wait_for as wait_for_each
from jlora.adapters.peft import make_demo_adapters
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.cli.common import model_config
from jlora.cli.supervisor import Backoff, Supervisor
from jlora.contract.lifetime import child_env
from jlora.engine.mock import MockTokenizer, mock_engine
from jlora.server import serve
from router.workers import WorkerPool
from tests.test_server import request
from tests.test_up import Up, _generate

pytestmark = pytest.mark.e2e  # end to end: `make test-e2e`

SERVING = health_pb2.HealthCheckResponse.SERVING
PROBE_TIMEOUT = 1.0  # the router's default poll_timeout


# -- processes, as /proc sees them ------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie has exited


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[1], []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def command_line(pid: int) -> list[str]:
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return []


def serve_pids(root: int) -> set[int]:
    """The `jlora serve` processes under `root`."""
    return {pid for pid in descendants(root) if "serve" in command_line(pid) and alive(pid)}


def shm_segments(pids: set[int]) -> set[str]:
    """The /dev/shm files the processes map."""
    found = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1]
                if path.startswith("/dev/shm/"):
                    found.add(path.removesuffix(" (deleted)"))
    return found


def listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


# Every 50 ms: the conditions here scan /proc or make a call, beside what they time.
wait_for = functools.partial(wait_for_each, interval=0.05)


# -- supervision under `jlora up` --------------------------------------------------------


def test_a_sigkilled_worker_comes_back_on_its_port_with_its_adapters(tmp_path):
    adapters = tmp_path / "adapters"
    config = model_config("cpu-tiny")
    (demo,) = make_demo_adapters(config, adapters, n=1, ranks=(8,))
    # Registered through the router at run time, in a subdirectory the worker's own
    # --adapters-dir scan does not list: only the registry knows it.
    (late,) = make_demo_adapters(config, adapters / "extra", n=1, ranks=(4,), seed=7)
    up = Up(tmp_path / "state", "--model", "cpu-tiny", "--workers", "1", "--max-seq-len", "64",
            "--max-slots", "4", "--adapters-dir", str(adapters))  # fmt: skip
    try:
        with grpc.insecure_channel(up.grpc) as channel:
            pb_grpc.JloraStub(channel).RegisterAdapter(
                pb.RegisterAdapterRequest(name="late", path=str(late.relative_to(adapters))),
                timeout=60,
            )
        prompts = [([3, 1, 4, 1, 5], name) for name in ("", demo.name, "late")]
        before = [_generate(up.grpc, ids, adapter) for ids, adapter in prompts]
        assert len({tuple(tokens) for tokens in before}) == 3  # each adapter matters
        (victim,) = serve_pids(up.pid)
        os.kill(victim, signal.SIGKILL)

        def served() -> bool:
            try:
                return _generate(up.grpc, *prompts[2]) == before[2]
            except grpc.RpcError:
                return False

        back = wait_for(served, 180, "the restarted worker to serve through the router")
        print(f"worker SIGKILLed, serving again through the router after {back:.1f} s")
        (restarted,) = serve_pids(up.pid)
        assert restarted != victim
        assert "exited: process 0 killed by SIGKILL; restarting it in 1 s" in "".join(up.log)
        # The port it had; said once `jlora up` reads it, which may follow the router's
        # first good probe.
        back_on = f"worker 0 is back on {up.workers[0]}"
        wait_for(lambda: back_on in "".join(up.log), 30, back_on)
        assert [_generate(up.grpc, ids, adapter) for ids, adapter in prompts] == before
        with grpc.insecure_channel(up.workers[0]) as channel:
            listed = pb_grpc.JloraStub(channel).ListAdapters(pb.ListAdaptersRequest(), timeout=10)
        assert {a.name for a in listed.adapters} == {demo.name, "late"}
    finally:
        assert up.stop() == 0


def test_a_sigkilled_up_leaves_no_process_listener_segment_or_temp_file(tmp_path, monkeypatch):
    temp = tmp_path / "tmp"  # the TMPDIR of `jlora up` and its workers
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    up = Up(tmp_path / "state", "--model", "cpu-tiny", "--workers", "2", "--max-seq-len", "64",
            "--max-slots", "4")  # fmt: skip
    processes = descendants(up.pid)
    assert len(serve_pids(up.pid)) == 2
    segments = shm_segments(processes)
    assert segments, "the workers' host stores live in /dev/shm"
    ports = [int(address.rpartition(":")[2]) for address in (up.grpc, *up.workers)]
    ports.append(int(up.http.rpartition(":")[2].split("/")[0]))
    assert all(listening(port) for port in ports)

    up.kill()  # the leader alone: its workers must follow it by themselves
    try:
        gone = wait_for(
            lambda: not any(alive(pid) for pid in processes), 30, "every worker process to exit"
        )
        print(f"jlora up SIGKILLed: its {len(processes)} processes gone after {gone:.1f} s")
        assert not [port for port in ports if listening(port)]
        assert not [segment for segment in segments if Path(segment).exists()]
        assert not list(temp.iterdir())
    finally:  # orphans, if the test failed
        for pid in processes:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- the supervisor and the parent-death signal, on stand-in processes ------------------

# A stand-in worker: writes port 4321 (or the port it is given) to its port file, lives
# argv[3] seconds, exits with status 1.
STAND_IN = """
import sys, time
port_file, port, lifetime = sys.argv[1], int(sys.argv[2]) or 4321, float(sys.argv[3])
with open(port_file, "w") as out:
    out.write(f"{port}\\n")
time.sleep(lifetime)
sys.exit(1)
"""


def _supervise(lifetime: float, backoff: Backoff, seconds: float) -> tuple[list, Supervisor]:
    """Run a supervisor of one stand-in worker for `seconds`; (monotonic time, port) of
    every start."""
    starts: list[tuple[float, int]] = []

    def launch(index: int, port: int, port_file: str) -> list[list[str]]:
        assert index == 0
        starts.append((time.monotonic(), port))
        return [[sys.executable, "-c", STAND_IN, port_file, str(port), str(lifetime)]]

    messages: list[str] = []
    supervisor = Supervisor(launch, 1, env=dict(os.environ), backoff=backoff, say=messages.append)
    try:
        assert supervisor.start(timeout=30) == [4321]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            supervisor.tick()
            time.sleep(0.01)
    finally:
        supervisor.stop(grace=0)
    assert all(not alive(pid) for pid in supervisor.workers[0].pids)
    return starts, supervisor


def test_a_crashing_worker_is_restarted_on_its_port_after_growing_delays():
    backoff = Backoff(first=0.2, cap=0.8, stable_after=60)
    starts, supervisor = _supervise(lifetime=0.0, backoff=backoff, seconds=3.5)
    assert [port for _, port in starts] == [0] + [4321] * (len(starts) - 1)
    gaps = [later - earlier for (earlier, _), (later, _) in zip(starts, starts[1:], strict=False)]
    # Each gap: the process's life (~0.1 s of Python start-up) plus the delay.
    expected = [backoff.delay(crash) for crash in range(1, len(gaps) + 1)]
    assert expected[:4] == [0.2, 0.4, 0.8, 0.8]
    assert len(gaps) >= 3
    for gap, delay in zip(gaps, expected, strict=False):
        assert delay <= gap < delay + 1.0, (gaps, expected)
    assert supervisor.workers[0].crashes >= 3


def test_a_worker_that_stayed_up_restarts_after_the_first_delay_again():
    backoff = Backoff(first=0.2, cap=5, stable_after=0.3)
    starts, supervisor = _supervise(lifetime=0.6, backoff=backoff, seconds=3)
    gaps = [later - earlier for (earlier, _), (later, _) in zip(starts, starts[1:], strict=False)]
    assert len(gaps) >= 2
    assert all(0.6 + 0.2 <= gap < 0.6 + 0.2 + 1.0 for gap in gaps), gaps
    assert supervisor.workers[0].crashes == 1


# A parent that starts a child which must die with it, prints the child's pid, waits.
PARENT = """
import subprocess, sys, time
from jlora.contract.lifetime import child_env
import os
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=child_env(os.environ))
print(child.pid, flush=True)
time.sleep(120)
"""
CHILD = """
import sys, time
import jlora.contract.lifetime as lifetime

if {watch_only}:
    lifetime._set_parent_death_signal = lambda signum: None
assert lifetime.die_with_parent()
assert lifetime.PARENT_ENV not in __import__("os").environ
print("armed", flush=True)
time.sleep(120)
"""


@pytest.mark.serial
@pytest.mark.parametrize("watch_only", [False, True], ids=["parent-death-signal", "watch"])
def test_a_child_dies_with_its_sigkilled_parent(watch_only):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD.format(watch_only=watch_only)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert parent.stdout.readline() == "armed\n"  # the child's, on the same pipe
    parent.kill()
    parent.wait()
    took = wait_for(lambda: not alive(child), 10, "the child to exit")
    # The signal is immediate; the watch looks once a second.
    assert took < (2.5 if watch_only else 1.0), took


def test_child_env_names_this_process():
    assert child_env({"A": "1"}) == {"A": "1", "JLORA_PARENT_PID": str(os.getpid())}


# -- health with hysteresis ---------------------------------------------------------------


class FakeWorker:
    """A grpc.aio server answering the router's polls as a worker would, whose next
    `stall(n)` health probes and whose Stats calls (`stats_delay`) answer late. Start it
    on the loop that polls it."""

    def __init__(self) -> None:
        self.probes = 0
        self._stalls = 0
        self.stall_seconds = 0.0
        self.stats_delay = 0.0
        self.address = ""
        self.server: grpc.aio.Server | None = None

    def stall(self, probes: int, seconds: float) -> None:
        self._stalls, self.stall_seconds = probes, seconds

    async def start(self) -> None:
        fake = self

        class Health(health_pb2_grpc.HealthServicer):
            async def Check(self, request, context):  # noqa: N802
                fake.probes += 1
                if fake._stalls > 0:
                    fake._stalls -= 1
                    await asyncio.sleep(fake.stall_seconds)
                return health_pb2.HealthCheckResponse(status=SERVING)

        class Jlora(pb_grpc.JloraServicer):
            async def Models(self, request, context):  # noqa: N802
                return pb.ModelsResponse(
                    models=[pb.Model(id="base", kind=pb.MODEL_KIND_BASE, max_seq_len=64)]
                )

            async def Stats(self, request, context):  # noqa: N802
                await asyncio.sleep(fake.stats_delay)
                return pb.StatsResponse(max_slots=4, max_queue=4, free_slots=4)

            async def ListAdapters(self, request, context):  # noqa: N802
                return pb.ListAdaptersResponse()

        self.server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(Health(), self.server)
        pb_grpc.add_JloraServicer_to_server(Jlora(), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()


def _watch_pool(act: Callable[[FakeWorker], None], polls: int, **options) -> list:
    """Poll a FakeWorker with a WorkerPool (probe timeout 0.2 s); once it is up,
    `act(worker)`; then after every poll (up, probes missed in a row, reason), for
    `polls` polls."""
    seen: list[tuple[bool, int, str]] = []
    worker = FakeWorker()

    def change() -> None:
        (watched,) = pools[0].workers
        seen.append((watched.up, watched.missed, watched.reason))

    async def run() -> None:
        await worker.start()
        pool = WorkerPool(
            [worker.address], poll_interval=0.02, poll_timeout=0.2, on_change=change, **options
        )
        pools.append(pool)
        await pool.start(wait=5)
        assert pool.workers[0].up
        seen.clear()
        act(worker)
        deadline = time.monotonic() + 10
        while len(seen) < polls:
            assert time.monotonic() < deadline, f"{polls} polls took over 10 s: {seen}"
            await asyncio.sleep(0.02)
        await pool.close()
        assert worker.server is not None
        await worker.server.stop(0)

    pools: list[WorkerPool] = []
    asyncio.run(run())
    return seen


@pytest.mark.parametrize("stalls", [1, 2])
def test_a_worker_that_misses_one_or_two_probes_stays_up(stalls):
    seen = _watch_pool(lambda worker: worker.stall(stalls, 0.5), polls=stalls + 3)
    assert max(missed for _, missed, _ in seen) == stalls, seen
    assert all(up for up, _, _ in seen), seen
    assert seen[-1] == (True, 0, ""), seen


def test_a_worker_that_misses_three_probes_is_down_until_it_answers():
    seen = _watch_pool(lambda worker: worker.stall(3, 0.5), polls=6)
    assert all(up for up, missed, _ in seen if missed < 3), seen
    down = [(missed, reason) for up, missed, reason in seen if not up]
    assert down and down[0][0] == 3, seen
    assert down[0][1].startswith("DEADLINE_EXCEEDED") and "(3 probes in a row)" in down[0][1]
    assert seen[-1] == (True, 0, ""), seen  # back once it answers


def test_missed_probes_are_configurable():
    seen = _watch_pool(lambda worker: worker.stall(1, 0.5), polls=3, missed_probes=1)
    assert [missed for up, missed, _ in seen if not up] == [1], seen
    assert seen[-1] == (True, 0, ""), seen


def test_a_worker_too_busy_for_a_snapshot_stays_up():
    def busy(worker: FakeWorker) -> None:
        worker.stats_delay = 0.5  # its scheduler thread is in a long step

    seen = _watch_pool(busy, polls=4)
    assert len(seen) >= 4 and all(entry == (True, 0, "") for entry in seen), seen


# -- a busy worker answers its probes -----------------------------------------------------


class Prober:
    """Health probes every 20 ms on a thread, each with its latency (monotonic start,
    seconds; a probe that fails records infinity)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            start = time.monotonic()
            try:
                reply = self.stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                latency = time.monotonic() - start if reply.status == SERVING else float("inf")
            except grpc.RpcError:
                latency = float("inf")
            self.samples.append((start, latency))

    def during(self, start: float, end: float) -> list[float]:
        return [latency for at, latency in self.samples if start <= at <= end]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.channel.close()


class SlowTokenizer(MockTokenizer):
    """Takes `seconds` per encode, as a long prompt does (waiting without the GIL, as
    jlora.tokenizer's encode does)."""

    seconds = 2.0

    def encode(self, text: str) -> list[int]:
        time.sleep(self.seconds)
        return super().encode(text[:8])


def test_a_worker_tokenizing_a_long_prompt_answers_its_probes():
    engine = mock_engine()
    server = serve(engine, tokenizer=SlowTokenizer())
    prober = Prober(server.address)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.JloraStub(channel)
            start = time.monotonic()
            replies = list(stub.Generate(request(text="x" * 1000, max_tokens=2), timeout=30))
            end = time.monotonic()
        assert len(replies) == 2 and end - start >= SlowTokenizer.seconds
        latencies = prober.during(start, end)
        assert len(latencies) >= 20 and max(latencies) < 0.25, max(latencies)
    finally:
        prober.close()
        server.stop(grace=0)


class ServeProcess(ServerProcess):
    """A `jlora serve` process; `.address` once it listens."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        port_file = tmp_path / "port"
        super().__init__(
            [sys.executable, "-m", "jlora.cli.main", "serve", "--port", "0",
             "--port-file", str(port_file), *args],
            port_file=port_file, stdout="inherit", stderr="inherit", session=False,
            start_timeout_s=600,
        )  # fmt: skip
        self.address = f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 60.0, *, group: bool = False) -> int:
        """SIGTERM; a worker still running `timeout` s later fails the test (SIGKILLed)."""
        code = super().stop(timeout, group=group)
        assert code != -signal.SIGKILL, f"jlora serve did not exit within {timeout:g} s of SIGTERM"
        return code


@pytest.mark.serial
@pytest.mark.slow
def test_smollm2_busy_with_long_prefills_and_a_3mb_prompt_answers_its_probes(tmp_path):
    """Two 1000-token prefills, a burst of 32 short streams and a 3 MB text prompt (two
    seconds of tokenizing, then refused as longer than the context) at once: every
    probe is answered within the router's probe timeout."""
    worker = ServeProcess(tmp_path, "--max-seq-len", "1024", "--max-slots", "8")
    prober = Prober(worker.address)
    outcomes: list[str] = []

    def call(message: pb.GenerateRequest) -> None:
        with grpc.insecure_channel(worker.address) as channel:
            try:
                list(pb_grpc.JloraStub(channel).Generate(message, timeout=300))
                outcomes.append("ok")
            except grpc.RpcError as err:
                outcomes.append(err.code().name)

    long_ids = [(i * 7919) % 40000 + 100 for i in range(1000)]
    calls = [request(ids=long_ids[i:] + long_ids[:i], max_tokens=4) for i in (0, 1)]
    calls += [request(text=f"Count to {i}:", max_tokens=8) for i in range(32)]
    calls.append(request(text="The quick brown fox jumps over the lazy dog. " * 66_667))
    try:
        time.sleep(0.5)
        start = time.monotonic()
        threads = [threading.Thread(target=call, args=(message,)) for message in calls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        end = time.monotonic()
        latencies = prober.during(start, end)
        print(
            f"{len(calls)} calls in {end - start:.1f} s; {len(latencies)} health probes: "
            f"median {statistics.median(latencies) * 1e3:.0f} ms, "
            f"max {max(latencies) * 1e3:.0f} ms"
        )
        assert outcomes.count("ok") == len(calls) - 1, outcomes  # the 3 MB one is refused
        assert end - start > 2 * PROBE_TIMEOUT  # busy for longer than one probe's timeout
        assert max(latencies) < PROBE_TIMEOUT
    finally:
        prober.close()
        worker.stop()
