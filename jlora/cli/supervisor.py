"""`jlora up`'s workers, supervised: started, restarted when they exit, stopped.

A worker is one `jlora serve` process, or P of them forming one mesh (process 0 serves).
Its life under the `Supervisor`:

1. Start: its processes are spawned in sessions of their own (the terminal's Ctrl-C
   reaches only `jlora up`, which stops them in order) with `child_env`, so each dies
   with this process (jlora.contract.lifetime). Process 0 gets `--port-file /dev/fd/N`,
   the write end of a pipe: the port it listens on comes back through the pipe once it
   is warm. The first start is on port 0 (any free port); every later one is on the
   port it got then, so the router's address for it stays right.
2. Running: `tick()` (twice a second, from `jlora up`'s main loop) reads the port and
   notices exits. A process that exits unasked is a crash, whatever its status: the
   worker's other processes get SIGTERM (SIGKILL after `STOP_TIMEOUT`), and once all
   are gone the worker starts again, after a backoff (`Backoff`: 1 s, 2 s, 4 s... up to
   30 s; back to 1 s once a start has stayed up, listening, for a minute).
3. The restarted worker loads the registry's adapters itself (`--registry`, which holds
   those registered through the router at run time too). The router polls its address
   all along and takes it back once its health check passes, registering first any
   registered adapter it still lacks (router/workers.py, router/adapters.py).
4. `stop(grace)`: SIGTERM to each worker's process 0 (it drains; its followers exit
   with it), SIGKILL to whatever is left after grace + 30 s.

Why nothing is left behind when `jlora up` is SIGKILLed: nothing relies on it to clean
up, since a SIGKILLed process runs no code. There is no temporary file or directory (the
port comes back through a pipe, which the kernel closes with its last holder); each
worker gets SIGTERM from its parent-death signal and stops as on any SIGTERM: it drains,
closes its engine and unlinks its shared-memory segments (and a worker that is itself
SIGKILLed has its segments unlinked by multiprocessing's resource tracker, a process of
its own that outlives it). The parent-death signal follows the *thread* that spawned a
child, so every spawn happens on the thread that calls `start` and `tick` (the main
thread of `jlora up`), which lives as long as the process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from jlora.cli.common import UsageError
from jlora.contract.lifetime import child_env

# (worker index, port, port file) -> the command line of each of one worker's processes,
# process 0 first (only it gets the port file).
Launch = Callable[[int, int, str], list[list[str]]]

STOP_TIMEOUT = 10.0  # seconds a crashed worker's other processes get to exit on SIGTERM
_POLL = 0.2  # seconds between two looks while waiting for the first start


def _say(message: str) -> None:
    print(f"jlora up: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Backoff:
    """How long a crashed worker waits before its restart: `first` seconds after the
    first crash in a row, doubling with each further one up to `cap`; a start that
    stayed up (listening) for `stable_after` seconds ends the row."""

    first: float = 1.0
    cap: float = 30.0
    stable_after: float = 60.0

    def __post_init__(self) -> None:
        for field in ("first", "cap", "stable_after"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"Backoff.{field}={value!r} must be positive")

    def delay(self, crashes: int) -> float:
        """Seconds before the restart that follows crash number `crashes` in a row (>= 1)."""
        return min(self.cap, self.first * 2.0 ** (crashes - 1))


@dataclasses.dataclass(eq=False)
class SupervisedWorker:
    """One worker's processes and restart state (times are time.monotonic())."""

    index: int
    port: int = 0  # 0 until its first start has listened
    processes: list[subprocess.Popen] = dataclasses.field(default_factory=list)
    listening_since: float | None = None  # when this start's port came back
    crashes: int = 0  # in a row
    restarts: int = 0
    restart_at: float | None = None  # set from a crash until the restart
    kill_at: float = 0.0  # SIGKILL what is left of a crashed start after this
    _pipe: int | None = None  # read end of the port pipe, until the port has come
    _received: bytes = b""

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]


class Supervisor:
    """See the module docstring. `launch(index, port, port_file)` gives the command
    lines of worker `index` (0 .. workers - 1); `env` is the workers' environment. Call
    `start`, `tick` and `stop` on one thread that lives as long as this process (the
    main thread)."""

    def __init__(
        self,
        launch: Launch,
        workers: int,
        *,
        env: Mapping[str, str],
        host: str = "127.0.0.1",
        backoff: Backoff = Backoff(),
        say: Callable[[str], None] = _say,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be at least 1")
        self._launch = launch
        self._env = env
        self._host = host
        self.backoff = backoff
        self._say = say
        self.workers = [SupervisedWorker(index) for index in range(workers)]

    def start(self, timeout: float) -> list[int]:
        """Start every worker and return their ports once all listen; UsageError if a
        process exits first (a bad flag, a model that does not load: restarting would
        not help) or `timeout` seconds pass. Call `stop` afterwards either way."""
        for worker in self.workers:
            self._spawn(worker)
        deadline = time.monotonic() + timeout
        while True:
            for worker in self.workers:
                exited = [p for p in worker.processes if p.poll() is not None]
                self._read_port(worker)  # after the exits: a port written first is read
                if exited and worker.listening_since is None:
                    index = worker.processes.index(exited[0])
                    raise UsageError(
                        f"worker {worker.index} (process {index}) exited with code "
                        f"{exited[0].returncode} before it listened"
                    )
                # One that exited after listening is a crash: `tick` restarts it.
            if all(worker.listening_since is not None for worker in self.workers):
                return [worker.port for worker in self.workers]
            if time.monotonic() > deadline:
                raise UsageError(f"workers not listening after {timeout:.0f} s")
            time.sleep(_POLL)

    def tick(self) -> None:
        """Read the ports that came back, notice crashes, stop what is left of a crashed
        worker, restart those whose backoff is over. Returns at once."""
        now = time.monotonic()
        for worker in self.workers:
            if worker.restart_at is None:
                self._read_port(worker)
                if any(process.poll() is not None for process in worker.processes):
                    self._crashed(worker, now)
                continue
            alive = [process for process in worker.processes if process.poll() is None]
            if alive:
                if now >= worker.kill_at:
                    for process in alive:
                        process.kill()
            elif now >= worker.restart_at:
                worker.restarts += 1
                self._spawn(worker)

    def stop(self, grace: float) -> None:
        """SIGTERM every worker (see the module docstring) and wait for all to exit;
        SIGKILL after grace + 30 s. No restart follows."""
        for worker in self.workers:
            self._close_pipe(worker)
            alive = [process for process in worker.processes if process.poll() is None]
            # A running worker's followers exit with its process 0; a crashed one's
            # processes are each stopped already or get SIGTERM now.
            targets = alive[:1] if worker.restart_at is None else alive
            for process in targets:
                process.send_signal(signal.SIGTERM)
            worker.restart_at = None
        deadline = time.monotonic() + grace + 30
        for worker in self.workers:
            for process in worker.processes:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    # -- one worker -------------------------------------------------------------------

    def _spawn(self, worker: SupervisedWorker) -> None:
        read, write = os.pipe()
        os.set_blocking(read, False)
        worker._pipe, worker._received = read, b""
        worker.processes, worker.listening_since, worker.restart_at = [], None, None
        env = child_env(self._env)
        try:
            launch = self._launch(worker.index, worker.port, f"/dev/fd/{write}")
            for index, argv in enumerate(launch):
                worker.processes.append(
                    subprocess.Popen(
                        argv, env=env, start_new_session=True, pass_fds=() if index else (write,)
                    )
                )
        except OSError as err:  # cannot exec: counts as a crash (retried after the backoff)
            self._say(f"worker {worker.index}: cannot start: {err}")
            self._crashed(worker, time.monotonic())
        finally:
            os.close(write)  # the worker holds the only write end: EOF once it is gone

    def _read_port(self, worker: SupervisedWorker) -> None:
        if worker._pipe is None:
            return
        try:
            chunk = os.read(worker._pipe, 64)
        except BlockingIOError:
            return
        worker._received += chunk
        if chunk and b"\n" not in worker._received:
            return
        self._close_pipe(worker)
        text = worker._received.decode(errors="replace").strip()
        if not text.isdigit():  # it exited before listening: the exit is noticed next
            return
        worker.port, worker.listening_since = int(text), time.monotonic()
        if worker.restarts:
            self._say(
                f"worker {worker.index} is back on {self._host}:{worker.port} "
                f"(pid {', '.join(map(str, worker.pids))}, restart {worker.restarts})"
            )

    def _crashed(self, worker: SupervisedWorker, now: float) -> None:
        self._close_pipe(worker)
        stable = (
            worker.listening_since is not None
            and now - worker.listening_since >= self.backoff.stable_after
        )
        worker.crashes = 1 if stable else worker.crashes + 1
        delay = self.backoff.delay(worker.crashes)
        worker.restart_at, worker.kill_at = now + delay, now + STOP_TIMEOUT
        exits = [
            f"process {index} {_describe(process.returncode)}"
            for index, process in enumerate(worker.processes)
            if process.poll() is not None
        ]
        where = f"{self._host}:{worker.port}" if worker.port else "not listening yet"
        self._say(
            f"worker {worker.index} ({where}) exited: {', '.join(exits) or 'not started'}; "
            f"restarting it in {delay:g} s (crash {worker.crashes} in a row)"
        )
        for process in worker.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        worker.listening_since = None

    def _close_pipe(self, worker: SupervisedWorker) -> None:
        if worker._pipe is not None:
            with contextlib.suppress(OSError):
                os.close(worker._pipe)
            worker._pipe = None


def _describe(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"with code {returncode}"
