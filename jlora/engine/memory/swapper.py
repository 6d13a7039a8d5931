"""FastLibra's performance-driven cache swapper (§5): what to keep on the device.

Every node of the tree (an adapter or a KV block) is valued by Eq. 6,

    Eval_i = LoRA_Eval_i × Retain_Eval_i,

the expected benefit to the time to first token of keeping it on the device:

- Eq. 3, the adapters a batch needs: Low_lora = Σ_i 1 - (1 - prob_i)^BS, with prob_i the
  share of requests that used adapter i and BS the mean running batch over the last 5 s.
- Eq. 4, the adapter reward: LoRA_Eval_i = max(1, Low_lora / Now_lora), Now_lora the
  adapters on the device. The paper writes it for "a KV cache or LoRA i"; it is applied
  to adapter nodes only, and KV nodes get 1. Its purpose is to load enough adapters:
  raising a KV node by the same factor would not change the order among KV nodes, but
  would cancel the reward where it matters, between an adapter and the KV that competes
  with it for the same pages.
- Eq. 5, the retention benefit: Retain_Eval_i = cost_i × prob_i × (1 - sigmoid(t_i)):
  cost_i the seconds its bytes take over the measured link (or the emulated one);
  prob_i the share of requests that visited the node (for a KV node, requests that
  matched that block under its adapter, so it never exceeds its adapter's: the paper
  leaves the normalisation of KV nodes open, and this one keeps the two kinds on one
  scale); t_i the seconds since the node was last used. t is in seconds because the
  paper's decay is the LSTM forget gate's over a wall-clock gap and its monitor runs
  every 100 ms: a node idle for a few seconds has lost most of its value, which suits
  interactive sessions whose turns come seconds apart.

Workflow (§5.3): every `INTERVAL_S` the pool's usage is compared with two marks. Above
`HIGH` (95%) the device leaves are swapped out in increasing Eval order until usage is
back at the high mark; below `LOW` (70%) the host nodes whose parent is on the device
are swapped in in decreasing Eval order while usage stays at or below the low mark.
Between the marks nothing moves. Swap-in stops at the low mark, so what it brings in
can never push usage over the high one by itself: no ping-pong between the marks.
"""

from __future__ import annotations

import collections
import dataclasses
import math

HIGH, LOW = 0.95, 0.70  # FastLibra §5.3's marks
INTERVAL_S = 0.1  # FastLibra §5.3's monitor interval
BATCH_WINDOW_S = 5.0  # Eq. 3's "recent inference batch size" window


def sigmoid(t: float) -> float:
    return 1.0 / (1.0 + math.exp(-t)) if t > -60 else 0.0


def low_lora(probs: list[float], batch: float) -> float:
    """Eq. 3: the expected number of distinct adapters in a batch of `batch` requests."""
    return sum(1.0 - (1.0 - p) ** batch for p in probs)


def lora_eval(low: float, now_lora: int) -> float:
    """Eq. 4 (adapter nodes): the reward for loading more adapters while fewer than
    Low_lora are on the device."""
    return max(1.0, low / now_lora) if now_lora else max(1.0, low)


def retain_eval(cost_s: float, prob: float, idle_s: float) -> float:
    """Eq. 5: transfer cost × visit probability × recency decay."""
    return cost_s * prob * (1.0 - sigmoid(idle_s))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One node as the cost model sees it."""

    ref: object  # the caller's handle (a tree node)
    is_lora: bool
    nbytes: int
    visits: int
    last_used: float


@dataclasses.dataclass
class Demand:
    """The measured inputs of Eqs. 3-5 that are not per node."""

    link_bytes_per_s: float
    total_visits: int  # requests admitted (the denominator of every prob)
    adapter_visits: list[int]  # per adapter, for Eq. 3
    batch: float  # recent mean running batch (Eq. 3's BS)
    now_lora: int  # adapters on the device (Eq. 4)

    def low_lora(self) -> float:
        total = max(self.total_visits, 1)
        return low_lora([v / total for v in self.adapter_visits], self.batch)


def evaluate(candidate: Candidate, demand: Demand, now: float) -> float:
    """Eq. 6 for one node."""
    prob = candidate.visits / max(demand.total_visits, 1)
    cost = candidate.nbytes / demand.link_bytes_per_s
    value = retain_eval(cost, prob, now - candidate.last_used)
    if candidate.is_lora:
        value *= lora_eval(demand.low_lora(), demand.now_lora)
    return value


def order(candidates: list[Candidate], demand: Demand, now: float, *, ascending: bool):
    """Candidates by Eval, lowest first for swap-out (ascending) or highest first for
    swap-in; ties broken by least recent use first (then as given)."""
    keyed = [(evaluate(c, demand, now), c.last_used, i, c) for i, c in enumerate(candidates)]
    keyed.sort(key=lambda k: (k[0] if ascending else -k[0], k[1], k[2]))
    return [c for *_, c in keyed]


class BatchWindow:
    """The running batch size over the last BATCH_WINDOW_S seconds (Eq. 3's BS)."""

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, rows: int) -> None:
        self._samples.append((now, rows))
        while self._samples and self._samples[0][0] < now - BATCH_WINDOW_S:
            self._samples.popleft()

    def mean(self) -> float:
        if not self._samples:
            return 1.0
        return max(1.0, sum(r for _, r in self._samples) / len(self._samples))
