"""A server under test or benchmark: a child process started as a user starts it, ready
once it says where it listens (`ServerProcess`); `wait_for` a condition; and a server's
Prometheus counters (`scrape`).

A server says where it listens in a line of its output (`ready`, a regex: `jlora up`
prints `jlora.cli.up.LISTENING`'s line on stderr, the PyTorch baseline its own on
stdout) or in a file (`port_file`: `jlora serve --port-file`). Each of its streams is
read into memory ("log"; stdout and stderr both "log" share one pipe, in the order
printed), written to a file (a Path) or left to this process's ("inherit"). In a
session of its own (`session`, the default), stopping it reaches every process it
started, and a terminal's Ctrl-C does not.

Imports only the standard library: the tests that start servers load nothing more.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Literal

ROOT = Path(__file__).resolve().parents[2]
# name -> (a counter's series, the labels it must have): summed over its other labels.
Counters = Mapping[str, tuple[str, Mapping[str, str]]]
# Where one of the child's streams goes: read into `ServerProcess.log`, a file, or ours.
Output = Literal["log", "inherit"] | Path
READ_TAIL_S = 5.0  # after an exit, how long the output still being read may take


class ServerProcess:
    """`argv` started in `cwd`, `stdout` and `stderr` as `Output` says (see the module
    docstring). Ready once a line read matches `ready` (its groups in `self.groups`) or
    once `port_file` holds a port (`self.port`): the constructor blocks until then, or
    with `wait=False` returns at once and `wait_ready()` blocks. If the process exits
    first, or `start_timeout_s` passes (counted from the wait's start), it is stopped and
    RuntimeError raised with its output's tail. `self.log` holds every line read so far.
    """

    def __init__(
        self,
        argv: Sequence[str],
        ready: re.Pattern[str] | None = None,
        *,
        port_file: Path | None = None,
        stdout: Output = "log",
        stderr: Output = "log",
        env: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
        session: bool = True,
        start_timeout_s: float = 900.0,
        wait: bool = True,
    ) -> None:
        if (ready is None) == (port_file is None):
            raise ValueError("give either ready (a regex on the output) or port_file")
        if ready is not None and "log" not in (stdout, stderr):
            raise ValueError("ready reads the output: stdout or stderr must be 'log'")
        self.argv = list(argv)
        self.ready, self.port_file = ready, port_file
        self.session = session
        self.start_timeout_s = start_timeout_s
        self.files = [path for path in (stdout, stderr) if isinstance(path, Path)]
        self.log: list[str] = []
        self.groups: tuple[str, ...] = ()
        self.port: int | None = None
        self._ready = threading.Event()
        opened: list[IO[str]] = []

        def stream(output: Output) -> int | IO[str] | None:
            if output == "log":
                return subprocess.PIPE
            if isinstance(output, Path):
                opened.append(output.open("w"))
                return opened[-1]
            return None

        merged = stdout == stderr == "log"
        try:
            self.process = subprocess.Popen(
                self.argv,
                cwd=cwd,
                stdout=stream(stdout),
                stderr=subprocess.STDOUT if merged else stream(stderr),
                text=True,
                start_new_session=session,
                env={**os.environ, **(env or {})},
            )
        finally:
            for file in opened:  # the child has its own copy
                file.close()
        pipe = self.process.stdout if stdout == "log" else self.process.stderr
        self._reader: threading.Thread | None = None
        if pipe is not None:
            self._reader = threading.Thread(target=self._read, args=(pipe,), daemon=True)
            self._reader.start()
        if wait:
            self.wait_ready()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            self.log.append(line)
            if self.ready and not self._ready.is_set() and (match := self.ready.search(line)):
                self.groups = match.groups()
                self._ready.set()

    def _port(self) -> bool:
        """Whether the port file holds a port yet (then in `self.port`)."""
        assert self.port_file is not None
        try:
            text = self.port_file.read_text().strip()
        except FileNotFoundError:
            return False
        if text:
            self.port = int(text)
        return bool(text)

    def is_ready(self) -> bool:
        return self._ready.is_set() or (self.port_file is not None and self._port())

    def wait_ready(self) -> ServerProcess:
        """Block until the server is ready (see the class docstring); itself."""
        deadline = time.monotonic() + self.start_timeout_s
        while not self.is_ready():
            if self.process.poll() is not None:
                self._finish_reading()  # the ready line may be among the last read
                if self.is_ready():
                    break
                raise RuntimeError(
                    f"{self.argv[:4]} exited with {self.process.returncode} before it was "
                    f"ready:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                ServerProcess.stop(self)  # not a subclass's: it may need what ready gives
                raise RuntimeError(
                    f"{self.argv[:4]} was not ready within {self.start_timeout_s:g} s:\n"
                    f"{self.tail()}"
                )
            self._ready.wait(0.05)
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code, None while it runs (negative: the signal that ended it)."""
        return self.process.poll()

    def output(self) -> str:
        """Everything read so far, then each file's text (`stdout`, `stderr` as Paths)."""
        texts = ["".join(self.log)]
        texts += [path.read_text(errors="replace") for path in self.files if path.exists()]
        return "".join(texts)

    def tail(self, lines: int = 30) -> str:
        return "".join(self.output().splitlines(keepends=True)[-lines:])

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once it has exited (subprocess.TimeoutExpired after `timeout`
        s), its output read to the end."""
        code = self.process.wait(timeout=timeout)
        self._finish_reading()
        return code

    def stop(self, timeout: float = 120.0, *, group: bool = False) -> int:
        """SIGTERM (a drain: to the process, or with `group` to every process of its
        session at once), then SIGKILL after `timeout` s (to the session, or the process
        alone where it has none of its own); the exit code. With `group`, the session's
        other processes get SIGTERM even where the process itself has exited."""
        if self.process.poll() is None or group:
            self._signal(signal.SIGTERM, group=group)
            try:
                return self.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL, group=self.session)
        return self.wait()

    def kill(self) -> int:
        """SIGKILL to the process alone (what a crash looks like to the processes it
        started); the exit code."""
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait()

    def _signal(self, signum: int, *, group: bool) -> None:
        if group and not self.session:
            raise ValueError("only a process in a session of its own has a group to signal")
        if not group:
            self.process.send_signal(signum)  # nothing once it has exited
            return
        with contextlib.suppress(ProcessLookupError):  # no process of the group is left
            os.killpg(self.process.pid, signum)

    def _finish_reading(self) -> None:
        if self._reader is not None:
            self._reader.join(READ_TAIL_S)


def wait_for(
    condition: Callable[[], object],
    timeout: float = 10.0,
    what: str = "the condition",
    *,
    interval: float = 0.01,
) -> float:
    """Seconds until `condition()` held, asked every `interval` s; AssertionError naming
    `what` if it did not within `timeout` s."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start >= timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


def parse_counters(text: str, counters: Counters) -> dict[str, int]:
    """`counters` from a Prometheus text exposition (0 for a series not there)."""
    samples: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)", line)
        if match is None or line.startswith("#"):
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        samples.append((match.group(1), labels, float(match.group(3))))
    counts = {}
    for key, (name, wanted) in counters.items():
        total = sum(
            value
            for sample, labels, value in samples
            if sample == name and all(labels.get(k) == v for k, v in wanted.items())
        )
        counts[key] = int(total)
    return counts


def scrape(url: str, counters: Counters) -> dict[str, int]:
    """`counters` from the Prometheus endpoint at `url` (.../metrics)."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        return parse_counters(reply.read().decode(), counters)
