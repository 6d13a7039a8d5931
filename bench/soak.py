"""Soak: minutes of mixed streaming load against `jlora up`, and what it leaves behind.

`python -m bench.soak --minutes 30` (`make soak`):

1. Starts `jlora up` with two workers (SmolLM2 and its three demo adapters by default)
   in a fresh state directory, and asks every case once, one at a time: each case's
   greedy text is then known.
2. Load: `--clients` threads, each asking cases in a seeded random order through the
   official `openai` client (chat, streamed; completions) or gRPC (`Generate`, text or
   chat), so every front door and both prompt forms are in the mix. Every answer is
   checked against its case's known text: a different text is a *changed* output
   (a repeated or missing token shows up there), an answer that never came (past the
   client's deadline, or a stream that ended without a finish reason) is *lost*. An
   error with a status and a message (the router's UNAVAILABLE for a stream no worker
   could resume after its own died, NOT_FOUND for an adapter unregistered a moment
   before) is a *clear error*.
3. Meanwhile an adapter is registered under a new name (the weights of `demo-01-r16`,
   so its answers must equal that adapter's) and unregistered again, over and over
   (vLLM's HTTP adapter endpoints), and midway one worker is SIGKILLed: `jlora up`
   must restart it and the router must take it back.
4. Every `--sample-s` seconds: RSS and open fds of `jlora up` and each worker, the
   entries in /dev/shm, and each worker's decode slots and adapter slots in use and KV
   blocks held by requests (gRPC `Stats`; with a pool shared by KV and adapters, the
   adapters' pages and the prefix cache's blocks apart). After the load stops, the
   samples go on for a while: the slopes over the load and what is left after it tell
   whether anything leaks.
5. SIGTERM: `jlora up` drains and exits; /dev/shm and the temporary directories must
   be as they were before it started.

The table goes to `--markdown` (bench/results/), every request and sample to `--json`
(bench/out/).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai

from bench.lib.processes import ROOT, ServerProcess, scrape
from bench.lib.report import dated_stem, machine_facts, write_report
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.cli.up import LISTENING

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a LoRA adapter is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 3?",
    "Name a famous painting.",
    "Give me a tip for learning to cook.",
)
ROTATING = "soak-rotating"  # registered and unregistered during the run
ROTATING_WEIGHTS = "demo-01-r16"  # ... with this adapter's weights
APIS = ("openai-chat-stream", "openai-completions", "grpc-text", "grpc-chat")
# The router's counters of requests a failed worker left: placed again before their first
# token, resumed elsewhere after one.
ROUTER_COUNTERS = {
    "reroutes": ("jlora_router_reroutes_total", {}),
    "resumes": ("jlora_router_resumes_total", {}),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    minutes: float = 30.0
    model: str = "smollm2-135m"
    workers: int = 2
    clients: int = 8
    max_tokens: int = 16
    kill_at: float = 0.4  # the share of the load after which a worker is SIGKILLed
    rotate_s: float = 20.0  # the rotating adapter is registered, then unregistered, this often
    sample_s: float = 5.0
    after_s: float = 60.0  # samples after the load stops
    deadline_s: float = 120.0  # a request not answered by then is lost
    seed: int = 0


@dataclasses.dataclass
class Outcome:
    api: str
    adapter: str
    start: float
    ttft: float | None = None
    latency: float | None = None
    text: str | None = None
    error: str | None = None  # a clear error: its status and message
    lost: str | None = None  # no answer, or no proper end
    changed: bool = False


class Up(ServerProcess):
    """`jlora up` as a user starts it: its router's gRPC and HTTP addresses, its workers'."""

    def __init__(self, plan: Plan, state_dir: Path) -> None:
        super().__init__(
            [sys.executable, "-m", "jlora.cli.main", "up", "--model", plan.model,
             "--workers", str(plan.workers), "--port", "0", "--http-port", "0",
             "--state-dir", str(state_dir)],
            LISTENING,
        )  # fmt: skip
        self.grpc, self.http, workers = self.groups
        self.workers = workers.split(", ")

    def worker_pids(self) -> dict[int, int]:
        """Worker index -> the pid of the `jlora serve` process now listening on that
        worker's address (`self.workers[index]`)."""
        ports = {int(address.rsplit(":", 1)[1]): i for i, address in enumerate(self.workers)}
        listening = _listening_ports()  # socket inode -> port
        pids = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or _parent(int(entry.name)) != self.pid:
                continue
            with contextlib.suppress(OSError):
                for fd in (entry / "fd").iterdir():
                    port = listening.get(os.readlink(fd))
                    if port in ports:
                        pids[ports[port]] = int(entry.name)
        return pids


def _openai(up: Up, api: str, prompt: str, model: str, plan: Plan, out: Outcome) -> None:
    client = openai.OpenAI(base_url=up.http, api_key="none", timeout=plan.deadline_s,
                           max_retries=0)  # fmt: skip
    if api == "openai-completions":
        reply = client.completions.create(
            model=model, prompt=prompt, max_tokens=plan.max_tokens, temperature=0
        )
        out.latency = time.monotonic() - out.start
        out.text = reply.choices[0].text
        if reply.choices[0].finish_reason not in ("stop", "length"):
            out.lost = f"finish_reason {reply.choices[0].finish_reason!r}"
        return
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}],
        max_tokens=plan.max_tokens, temperature=0, stream=True,
    )  # fmt: skip
    pieces, finish = [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        if out.ttft is None:
            out.ttft = time.monotonic() - out.start
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    out.latency = time.monotonic() - out.start
    out.text = "".join(pieces)
    if finish is None:
        out.lost = "the stream ended without a finish reason"


def _grpc(up: Up, api: str, prompt: str, model: str, plan: Plan, out: Outcome) -> None:
    form: dict[str, Any] = (
        {"text": prompt}
        if api == "grpc-text"
        else {"chat": pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)])}
    )
    request = pb.GenerateRequest(
        adapter=model, sampling=pb.SamplingParams(max_tokens=plan.max_tokens), **form
    )
    pieces, finish = [], pb.FINISH_REASON_UNSPECIFIED
    with grpc.insecure_channel(up.grpc) as channel:
        for reply in pb_grpc.JloraStub(channel).Generate(request, timeout=plan.deadline_s):
            if out.ttft is None:
                out.ttft = time.monotonic() - out.start
            pieces.append(reply.text)
            finish = reply.finish_reason or finish
    out.latency = time.monotonic() - out.start
    out.text = "".join(pieces)
    if finish == pb.FINISH_REASON_UNSPECIFIED:
        out.lost = "the stream ended without a finish reason"


def ask(up: Up, api: str, prompt: str, model: str, plan: Plan) -> Outcome:
    """One request; whatever happens is in the Outcome."""
    out = Outcome(api=api, adapter=model, start=time.monotonic())
    try:
        (_openai if api.startswith("openai") else _grpc)(up, api, prompt, model, plan, out)
    except openai.APIStatusError as error:
        out.error = f"HTTP {error.status_code}: {error.message}"
        if error.status_code == 500:  # a status that says nothing is not a clear error
            out.lost = out.error
    except openai.APITimeoutError:
        out.lost = f"no answer within {plan.deadline_s:.0f} s"
    except openai.APIError as error:  # an error event inside a stream
        out.error = f"stream error: {error.message}"
    except grpc.RpcError as error:
        code = error.code()
        out.error = f"{code.name}: {error.details()}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            out.lost = f"no answer within {plan.deadline_s:.0f} s"
        elif code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            out.lost = out.error
    return out


def _form(api: str) -> str:
    return "chat" if "chat" in api else "text"


def _expected_key(api: str, prompt: str, adapter: str) -> tuple[str, str, str]:
    weights = ROTATING_WEIGHTS if adapter == ROTATING else adapter
    return _form(api), prompt, weights


class Soak:
    def __init__(self, plan: Plan, up: Up, models: list[str]) -> None:
        self.plan, self.up = plan, up
        self.models = [*models, ROTATING]
        self.expected: dict[tuple[str, str, str], str] = {}
        self.outcomes: list[Outcome] = []
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.load_over = threading.Event()
        self.all_over = threading.Event()

    def learn(self) -> None:
        """Every (form, prompt, weights) once, one at a time, before the load."""
        for prompt in PROMPTS:
            for model in self.models[:-1]:
                for api in ("grpc-text", "grpc-chat"):
                    out = ask(self.up, api, prompt, model, self.plan)
                    if out.text is None or out.lost:
                        raise RuntimeError(f"{api} {model!r} failed before the load: {out}")
                    self.expected[_expected_key(api, prompt, model)] = out.text

    def client(self, index: int) -> None:
        rng = np.random.default_rng([self.plan.seed, index])
        while not self.load_over.is_set():
            api = APIS[rng.integers(len(APIS))]
            prompt = PROMPTS[rng.integers(len(PROMPTS))]
            model = self.models[rng.integers(len(self.models))]
            out = ask(self.up, api, prompt, model, self.plan)
            if out.text is not None and not out.lost:
                out.changed = out.text != self.expected[_expected_key(api, prompt, model)]
            with self.lock:
                self.outcomes.append(out)

    def rotate(self) -> None:
        """Register the rotating adapter, unregister it, ... (vLLM's HTTP endpoints). An
        unregistration refused while requests name it (400) is tried again a second later."""
        registered, wait = False, self.plan.rotate_s / 2
        while not self.load_over.wait(wait):
            wait = 1.0
            if self._set_rotating(not registered) == 200:
                registered, wait = not registered, self.plan.rotate_s / 2
        for _ in range(60):
            if not registered or self._set_rotating(False) == 200:
                return
            time.sleep(1.0)

    def _set_rotating(self, register: bool) -> int:
        path, body = (
            ("load_lora_adapter", {"lora_name": ROTATING, "lora_path": ROTATING_WEIGHTS})
            if register
            else ("unload_lora_adapter", {"lora_name": ROTATING})
        )
        request = urllib.request.Request(
            f"{self.up.http}/{path}", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                status, text = reply.status, ""
        except urllib.error.HTTPError as error:
            status, text = error.code, error.read().decode(errors="replace")
        self._event("register" if register else "unregister", status=status, error=text)
        return status

    def kill_one(self) -> None:
        """SIGKILL the first worker; wait until it answers again."""
        if self.load_over.wait(self.plan.kill_at * self.plan.minutes * 60):
            return
        pid = self.up.worker_pids()[0]  # its address is self.up.workers[0]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        self._event("SIGKILL worker", pid=pid)
        while not self.all_over.wait(1.0):
            if _stats(self.up.workers[0]) is not None:
                self._event("worker back", seconds=round(time.monotonic() - killed, 1))
                return
        self._event("worker not back by the end")

    def sample_forever(self) -> None:
        while True:
            self.sample("after" if self.load_over.is_set() else "load")
            if self.all_over.wait(self.plan.sample_s):
                return

    def sample(self, phase: str) -> None:
        row: dict[str, Any] = {"t": time.monotonic(), "phase": phase, "shm": _shm_entries()}
        pids = {"up": self.up.pid}
        pids.update((f"worker{i}", pid) for i, pid in self.up.worker_pids().items())
        for name, pid in pids.items():
            row[f"{name}_pid"] = pid
            row[f"{name}_rss_mib"] = _rss_mib(pid)
            row[f"{name}_fds"] = _fds(pid)
        for index, address in enumerate(self.up.workers):
            stats = _stats(address)
            if stats is not None:
                memory, slots = stats.memory, stats.adapter_slots
                # KV blocks running requests hold: with a pool shared by adapters and a
                # prefix cache, the used pages less the adapters' and the cached history
                if memory.HasField("cache"):
                    cache = memory.cache
                    row[f"worker{index}_kv_blocks"] = cache.pages_kv - cache.pages_kv_cached
                    row[f"worker{index}_cached_kv_blocks"] = cache.pages_kv_cached
                    row[f"worker{index}_adapter_pages"] = cache.pages_lora
                else:
                    row[f"worker{index}_kv_blocks"] = memory.kv_blocks_total - memory.kv_blocks_free
                row[f"worker{index}_slots"] = stats.max_slots - stats.free_slots
                row[f"worker{index}_adapter_slots"] = slots.total - slots.free
        with self.lock:
            self.samples.append(row)

    def _event(self, what: str, **data: Any) -> None:
        with self.lock:
            self.events.append({"t": time.monotonic(), "what": what, **data})
        print(f"soak: {what} {data or ''}", file=sys.stderr, flush=True)


def _stats(address: str) -> pb.StatsResponse | None:
    try:
        with grpc.insecure_channel(address) as channel:
            return pb_grpc.JloraStub(channel).Stats(pb.StatsRequest(), timeout=5)
    except grpc.RpcError:
        return None


def _rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return kib / 1024


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _shm_entries() -> int:
    return len(os.listdir("/dev/shm"))


def _temp_dirs() -> set[str]:
    return {path.name for path in Path(tempfile.gettempdir()).glob("jlora-*")}


def _listening_ports() -> dict[str, int]:
    """ "socket:[inode]" -> its port, for the TCP sockets listening on this machine."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    found[f"socket:[{fields[9]}]"] = int(fields[1].rsplit(":", 1)[1], 16)
    return found


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


# -- the run and its report ------------------------------------------------------------


def run(plan: Plan) -> dict[str, Any]:
    shm_before, temps_before = _shm_entries(), _temp_dirs()
    with tempfile.TemporaryDirectory(prefix="soak-state-") as state:
        up = Up(plan, Path(state))
        try:
            client = openai.OpenAI(base_url=up.http, api_key="none", max_retries=0)
            soak = Soak(plan, up, [model.id for model in client.models.list()])
            soak.learn()
            print(f"soak: {len(soak.expected)} answers known; load for {plan.minutes} min",
                  file=sys.stderr, flush=True)  # fmt: skip
            started = time.monotonic()
            threads = [
                threading.Thread(target=soak.client, args=(index,), daemon=True)
                for index in range(plan.clients)
            ]
            threads += [threading.Thread(target=soak.rotate, daemon=True)]
            helpers = [
                threading.Thread(target=target, daemon=True)
                for target in (soak.kill_one, soak.sample_forever)
            ]
            for thread in threads + helpers:
                thread.start()
            soak.load_over.wait(plan.minutes * 60)
            soak.load_over.set()
            for thread in threads:
                thread.join(plan.deadline_s + 60)
            load_s = time.monotonic() - started
            time.sleep(plan.after_s)
            soak.all_over.set()
            for thread in helpers:
                thread.join(30)
            router = scrape(up.http.removesuffix("/v1") + "/metrics", ROUTER_COUNTERS)
        finally:
            exit_code = up.stop()
    time.sleep(1.0)
    return {
        "load_s": load_s,
        "outcomes": [dataclasses.asdict(out) for out in soak.outcomes],
        "samples": soak.samples,
        "events": soak.events,
        "router": router,
        "exit": {
            "code": exit_code,
            "shm_before": shm_before,
            "shm_after": _shm_entries(),
            "temp_dirs_left": sorted(_temp_dirs() - temps_before),
        },
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    outcomes = result["outcomes"]
    done = [o for o in outcomes if o["text"] is not None and not o["lost"]]
    errors: dict[str, int] = {}
    for out in outcomes:
        if out["error"] and not out["lost"]:
            kind = out["error"].split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1

    def percentiles(values: list[float]) -> list[float]:
        return [float(np.percentile(values, q)) for q in (50, 90, 99)] if values else []

    samples = result["samples"]
    load = [row for row in samples if row["phase"] == "load"]
    after = [row for row in samples if row["phase"] == "after"]
    resources = {}
    keys = sorted({key for row in samples for key in row if key.endswith(("_mib", "_fds"))})
    for key in keys:
        pid_key = key.split("_")[0] + "_pid"
        last_pid = next((row.get(pid_key) for row in reversed(load) if row.get(key)), None)
        # the slope over the second half of the load, one process (a restarted worker
        # starts again): units per 10 minutes
        tail = [r for r in load[len(load) // 2 :] if r.get(pid_key) == last_pid and r.get(key)]
        slope = None
        if len(tail) >= 3:
            times = np.array([r["t"] for r in tail])
            slope = float(np.polyfit(times - times[0], [r[key] for r in tail], 1)[0] * 600)
        resources[key] = {
            "first": next((r[key] for r in load if r.get(key) is not None), None),
            "end_of_load": next((r[key] for r in reversed(load) if r.get(key)), None),
            "after": after[-1].get(key) if after else None,
            "slope_per_10min": slope,
        }
    in_use = {
        key: after[-1].get(key)
        for key in sorted(after[-1] if after else {})
        if key.endswith(("_kv_blocks", "_slots", "_pages"))
    }
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "clear_errors": errors,
        "lost": sum(1 for o in outcomes if o["lost"]),
        "lost_examples": [o["lost"] for o in outcomes if o["lost"]][:5],
        "changed": sum(1 for o in done if o["changed"]),
        "ttft_s": percentiles([o["ttft"] for o in done if o["ttft"] is not None]),
        "latency_s": percentiles([o["latency"] for o in done]),
        "resources": resources,
        "in_use_after": in_use,
        "shm_during": sorted({row["shm"] for row in samples}),
    }


def render(plan: Plan, facts: dict, result: dict, summary: dict) -> str:
    def fmt(value: Any) -> str:
        return "—" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)

    ttft, latency, events = summary["ttft_s"], summary["latency_s"], result["events"]
    lines = [
        f"# Soak: {plan.minutes:g} minutes against `jlora up` ({plan.workers} workers, "
        f"{plan.model})",
        "",
        f"{facts['date']}, {facts['cpu_count']} × {facts['cpu_model']}, jax {facts['jax']}; "
        f"{plan.clients} client threads (openai chat stream and completions, gRPC text and "
        f"chat), {plan.max_tokens} new tokens, greedy; `{ROTATING}` registered and "
        f"unregistered every {plan.rotate_s / 2:g} s; one worker SIGKILLed after "
        f"{plan.kill_at:.0%} of the load.",
        "",
        "| requests | completed | clear errors | lost | changed outputs |",
        "|---:|---:|---|---:|---:|",
        f"| {summary['requests']} | {summary['completed']} | "
        + (", ".join(f"{k} {v}" for k, v in summary["clear_errors"].items()) or "none")
        + f" | {summary['lost']} | {summary['changed']} |",
        "",
        "| latency (s) | p50 | p90 | p99 |",
        "|---|---:|---:|---:|",
        "| time to first token (streams) | " + " | ".join(f"{v:.2f}" for v in ttft) + " |",
        "| end to end | " + " | ".join(f"{v:.2f}" for v in latency) + " |",
        "",
        "Events: "
        + "; ".join(
            f"{event['what']}" + (f" ({event['seconds']} s)" if "seconds" in event else "")
            for event in events
            if event["what"] not in ("register", "unregister")
        )
        + f"; {sum(e['what'] == 'register' and e['status'] == 200 for e in events)} registrations"
        + "; the router placed {reroutes} requests again (their worker failed before their "
        "first token) and resumed {resumes} streams on another worker (after a token).".format(
            **result["router"]
        ),
        "",
        "| resource | first | end of load | after the load | slope, 2nd half (/10 min) |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, row in summary["resources"].items():
        lines.append(
            f"| {key} | {fmt(row['first'])} | {fmt(row['end_of_load'])} | "
            f"{fmt(row['after'])} | {fmt(row['slope_per_10min'])} |"
        )
    exit_ = result["exit"]
    lines += [
        "",
        "In use after the load: "
        + (", ".join(f"{k} {v}" for k, v in summary["in_use_after"].items()) or "—"),
        "",
        f"SIGTERM: `jlora up` exited {exit_['code']}; /dev/shm entries {exit_['shm_before']} "
        f"before, {exit_['shm_after']} after; temporary directories left: "
        f"{', '.join(exit_['temp_dirs_left']) or 'none'}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Plan):
        parser.add_argument(
            f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default
        )
    stem = dated_stem(ROOT / "bench" / "results", "cpu-soak")  # never a same-day run's
    parser.add_argument("--markdown", type=Path, default=ROOT / "bench" / "results" / f"{stem}.md")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / f"{stem}.json")
    args = parser.parse_args(argv)
    plan = Plan(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Plan)})
    facts = machine_facts()
    result = run(plan)
    summary = summarize(result)
    text = render(plan, facts, result, summary)
    print(text)
    for path in (args.markdown, args.json):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(text)
    write_report(args.json, facts, plan, [summary], raw=result)  # every request, every sample


if __name__ == "__main__":
    main()
