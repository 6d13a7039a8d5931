"""A server under benchmark: a child process started as a user starts it, ready once it
prints the line that says where it listens; and its Prometheus counters (`scrape`).

`jlora up` prints `jlora.cli.up.LISTENING`'s line on stderr; the PyTorch baseline prints
`bench.baselines.hf_server`'s on stdout; both streams are read together. The process
runs in its own session, so stopping it (SIGTERM, then SIGKILL after `timeout`) reaches
every process it started.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# name -> (a counter's series, the labels it must have): summed over its other labels.
Counters = Mapping[str, tuple[str, Mapping[str, str]]]


class ServerProcess:
    """`argv` started in ROOT; blocks until a line matches `ready` (its groups in
    `self.groups`) or raises RuntimeError with the log's tail if the process exits or
    `start_timeout_s` passes first. `self.log` holds every line printed so far."""

    def __init__(
        self,
        argv: Sequence[str],
        ready: re.Pattern[str],
        *,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 900.0,
    ) -> None:
        self.argv = list(argv)
        self.process = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.log: list[str] = []
        self.groups: tuple[str, ...] = ()
        started = threading.Event()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.log.append(line)
                if not started.is_set() and (match := ready.search(line)):
                    self.groups = match.groups()
                    started.set()

        threading.Thread(target=read, daemon=True).start()
        waited = 0.0
        while not started.wait(0.5):
            waited += 0.5
            if self.process.poll() is not None or waited > start_timeout_s:
                self.stop()
                raise RuntimeError(f"{self.argv[:4]} did not start:\n{self.tail()}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, lines: int = 30) -> str:
        return "".join(self.log[-lines:])

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (a drain), SIGKILL to the whole session after `timeout` s; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait()


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
