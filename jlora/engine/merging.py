"""dLoRA's dynamic batching: when to merge one adapter into the base weights, and which
requests run in each iteration (dLoRA, OSDI '24, §4.2 and Appendix A.1).

Merged inference runs one adapter's requests on W + B·A with no LoRA work; unmerged
inference batches every adapter (and the base model) on W plus per-row LoRA. Merged
iterations are cheaper, but serve only one adapter. `DynamicBatcher.plan` chooses,
each iteration, from the runnable requests in first-come first-served order:

1. Starvation prevention (Algorithm 3, lines 6-15): every adapter holds a credit, the
   same for all at first (max_bs: enough to merge once ahead of the FCFS order). An
   adapter enters the starving state when its credit exceeds `t_starve` and leaves it
   when its credit drops below `t_normal`; starving adapters' requests are served
   first. Departure from the paper: the rows they leave free are filled with the rest
   of the FCFS batch (the paper runs B_starve alone), so a starving adapter costs no
   throughput.
2. Dynamic batching (Algorithm 1) over the adapters eligible to merge (Algorithm 3,
   line 17: an adapter's credit must cover the credit that serving its batch instead
   of the FCFS batch costs). Unmerged: R_merge is the eligible adapter with the most
   runnable requests; if |R_merge[:max_bs]| / |B_fcfs| > alpha the replica merges it
   and runs R_merge[:max_bs]. Merged: if the merged adapter has no runnable request,
   is no longer eligible, or its ratio falls below beta, the replica unmerges and runs
   B_fcfs (or merges another adapter at once if that one's ratio exceeds alpha);
   else it runs R_merge[:max_bs].
3. Credit transfer (Algorithm 3, lines 14 and 20): the requests picked over the FCFS
   order (the merged batch, or the starving requests) pay one credit for each request of
   B_fcfs they displace, and each displaced request's adapter gains it (credit is
   conserved; it counts request-iterations). An adapter is eligible to merge (line 17)
   when its credit covers what its batch would pay. A starving adapter pays for the
   requests its own displace even though the free rows are then filled from B_fcfs, so
   it leaves the starving state after a few iterations of service.
4. Threshold tuning (Algorithm 2) at each break point: a switch, a change of the
   adapter R_merge names, or `period` iterations. Over the period just ended, the
   throughput (requests per second of iteration) of the mode that ran is measured
   and that of the other mode predicted from the step-time model (`StepTimes`, fitted
   online from the measured decode steps of each mode); the switch cost t_M is the
   measured time of the last merge or unmerge. After an unmerged period alpha moves:
   down by `gamma_dec` if merged would have been faster, else times `gamma_mul`. After a
   merged period beta moves the same way (the paper: "similar ... we omit the
   details"): down by `gamma_dec` when merged was faster (stay merged longer), else
   times `gamma_mul` (leave sooner). beta stays below alpha, so the two marks never
   cross.

The base model is a request type that never merges (there is nothing to fold in): in
an unmerged batch its rows run as usual; while an adapter is merged they wait, gaining
credit like any other adapter's requests.

Starvation bound (tested): a request in B_fcfs is left out of at most
`t_starve - t_normal + max_bs + 1` consecutive iterations. Its adapter gains at least
one credit in each such iteration; its credit never drops below
min(initial credit, t_normal - max_bs) (an adapter loses credit only when it is served
out of order: by merging, which needs credit ≥ its cost, or while starving, which ends
below t_normal after losing at most max_bs in an iteration); once above `t_starve` its
requests are served first. (The bound assumes initial credit ≥ t_normal - max_bs.)

Mode "always" is the merged-only strawman of the paper's §7.3: alpha = beta = 0 and no
tuning, so some adapter is merged whenever one has a runnable request; credits still
apply, so nothing starves. Mode "never" does not build a batcher.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Sequence

Item = Hashable  # a runnable request, opaque here (the orchestrator's sequence)


@dataclasses.dataclass(frozen=True)
class MergeSettings:
    """The knobs of Algorithms 1-3 (see the module docstring)."""

    alpha: float = 0.6  # merge when |R_merge| / |B_fcfs| exceeds it
    beta: float = 0.4  # unmerge when it falls below it
    gamma_dec: float = 0.05
    gamma_mul: float = 1.1
    min_alpha: float = 0.2
    max_alpha: float = 1.0  # at 1 nothing merges (the ratio is at most 1)
    min_beta: float = 0.05
    hysteresis: float = 0.1  # beta stays at most alpha - hysteresis
    t_starve: float = 32.0
    t_normal: float = 0.0
    initial_credit: float | None = None  # every type's credit at first (None: max_bs)
    period: int = 32  # iterations between break points without another event

    def __post_init__(self) -> None:
        for field in ("alpha", "beta", "gamma_dec", "min_alpha", "min_beta", "hysteresis"):
            value = getattr(self, field)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"MergeSettings.{field}={value!r} must be in [0, 1]")
        if self.gamma_mul < 1.0:
            raise ValueError(f"MergeSettings.gamma_mul={self.gamma_mul!r} must be >= 1")
        if self.t_normal > self.t_starve:
            raise ValueError(
                f"MergeSettings.t_normal={self.t_normal!r} must not exceed "
                f"t_starve={self.t_starve!r}"
            )
        if self.period < 1:
            raise ValueError(f"MergeSettings.period={self.period!r} must be positive")

    def starvation_bound(self, max_bs: int) -> int:
        """The most consecutive iterations a request in B_fcfs can be left out of."""
        return int(self.t_starve - self.t_normal) + max_bs + 1


@dataclasses.dataclass(frozen=True)
class Batch:
    """One iteration's choice: the requests to run, and the adapter merged while they
    run (None: unmerged)."""

    items: tuple[Item, ...]
    merged: str | None
    reason: str  # "fcfs", "merged", "starving"


class StepTimes:
    """Decode-step time against batch size, per mode, fitted online (least squares on
    the last `window` measured steps of each mode). Predicting a mode never measured
    borrows the other mode's fit: with no evidence, merging is assumed to cost the
    same per step as not merging."""

    def __init__(self, window: int = 256) -> None:
        self._samples = {
            mode: collections.deque[tuple[int, float]](maxlen=window) for mode in (True, False)
        }

    def observe(self, merged: bool, batch_size: int, seconds: float) -> None:
        if batch_size > 0 and seconds > 0:
            self._samples[merged].append((batch_size, seconds))

    def predict(self, merged: bool, batch_size: int) -> float | None:
        """Seconds of one decode step of `batch_size` rows; None without any sample."""
        fit = self._fit(merged) or self._fit(not merged)
        if fit is None:
            return None
        intercept, slope = fit
        return max(intercept + slope * batch_size, 1e-9)

    def _fit(self, merged: bool) -> tuple[float, float] | None:
        samples = self._samples[merged]
        if not samples:
            return None
        count = len(samples)
        mean_n = sum(n for n, _ in samples) / count
        mean_t = sum(t for _, t in samples) / count
        spread = sum((n - mean_n) ** 2 for n, _ in samples)
        if spread == 0:
            return mean_t, 0.0
        slope = sum((n - mean_n) * (t - mean_t) for n, t in samples) / spread
        slope = max(slope, 0.0)  # a step never gets cheaper with more rows
        return mean_t - slope * mean_n, slope


@dataclasses.dataclass
class _Iteration:
    """What Algorithm 2 needs of one iteration of a period."""

    merged_size: int  # |B_i| = |R_merge[:max_bs]|
    fcfs_size: int  # |B'_i| = |B_fcfs|
    seconds: float | None = None  # the measured decode step of the batch that ran


def _displaced(fcfs: Sequence[Item], served: Sequence[Item]) -> int:
    """How many of the FCFS batch running `served` in its place leaves out."""
    chosen = set(served)
    return sum(item not in chosen for item in fcfs)


class DynamicBatcher:
    """See the module docstring. `mode` is "auto" or "always"; `max_bs` the decode rows."""

    def __init__(self, mode: str, max_bs: int, settings: MergeSettings | None = None) -> None:
        if mode not in ("auto", "always"):
            raise ValueError(f"mode={mode!r} must be 'auto' or 'always'")
        if max_bs < 1:
            raise ValueError(f"max_bs={max_bs!r} must be positive")
        self.mode = mode
        self.max_bs = max_bs
        self.settings = settings = settings or MergeSettings()
        self.tuned = mode == "auto"
        self.alpha = settings.alpha if self.tuned else 0.0
        self.beta = min(settings.beta, settings.alpha - settings.hysteresis) if self.tuned else 0.0
        self.merged: str | None = None  # the replica's state S
        initial = float(max_bs if settings.initial_credit is None else settings.initial_credit)
        self.credits: collections.defaultdict[str | None, float] = collections.defaultdict(
            lambda: initial
        )
        self.starving: set[str | None] = set()
        self.times = StepTimes()
        self.switch_seconds = 0.0  # t_M, the last measured switch
        self.counters: collections.Counter[str] = collections.Counter()
        self._period: list[_Iteration] = []
        self._period_merged = False
        self._period_switch = 0.0  # t_M paid at the start of this period
        self._candidate: str | None = None  # the adapter R_merge names

    # -- one iteration --------------------------------------------------------------------

    def plan(self, runnable: Sequence[tuple[Item, str | None]]) -> Batch:
        """The batch of the next iteration from the runnable requests, in FCFS order, each
        with its adapter (None: the base model)."""
        fcfs = [item for item, _ in runnable[: self.max_bs]]
        kinds = dict(runnable)
        by_adapter: dict[str, list[Item]] = {}
        for item, adapter in runnable:
            if adapter is not None:
                by_adapter.setdefault(adapter, []).append(item)
        self._update_starving()
        starving = [item for item, adapter in runnable if adapter in self.starving]
        if starving:
            served = starving[: self.max_bs]
            chosen = served + [item for item in fcfs if item not in set(served)]
            chosen = chosen[: self.max_bs]
            merged = self.merged if all(kinds[i] == self.merged for i in chosen) else None
            return self._run(chosen, fcfs, kinds, merged, "starving", by_adapter, served)
        eligible = {
            adapter
            for adapter, items in by_adapter.items()
            if self.credits[adapter] >= _displaced(fcfs, items[: self.max_bs])
        }
        candidate = self._most_requested(by_adapter, eligible)
        if self.merged is not None:
            items = by_adapter.get(self.merged, [])[: self.max_bs]
            ratio = len(items) / max(len(fcfs), 1)
            if items and self.merged in eligible and not ratio < self.beta:
                return self._run(items, fcfs, kinds, self.merged, "merged", by_adapter, items)
            # Leaving the merged state: as from the unmerged state, another adapter may
            # merge at once (so "always" switches without an unmerged iteration between).
        if candidate is not None:
            items = by_adapter[candidate][: self.max_bs]
            if len(items) / max(len(fcfs), 1) > self.alpha:
                return self._run(items, fcfs, kinds, candidate, "merged", by_adapter, items)
        return self._run(fcfs, fcfs, kinds, None, "fcfs", by_adapter, [])

    def observe(self, merged: bool, batch_size: int, seconds: float) -> None:
        """The decode step of the last planned batch took `seconds` (`merged`: it ran
        merged; `batch_size`: its rows)."""
        self.times.observe(merged, batch_size, seconds)
        if self._period:
            self._period[-1].seconds = seconds
        self.counters["merged_iterations" if merged else "unmerged_iterations"] += 1

    def switched(self, seconds: float) -> None:
        """The engine merged or unmerged (as the last plan asked) in `seconds`."""
        self.switch_seconds = seconds
        self._period_switch = seconds
        self.counters["switches"] += 1

    # -- Algorithm 3: credits -------------------------------------------------------------

    def _update_starving(self) -> None:
        settings = self.settings
        for adapter, credit in self.credits.items():
            if adapter in self.starving and credit < settings.t_normal:
                self.starving.discard(adapter)
            elif credit > settings.t_starve:
                self.starving.add(adapter)

    def _transfer_credit(
        self,
        chosen: Sequence[Item],
        served: Sequence[Item],
        fcfs: Sequence[Item],
        kinds: dict[Item, str | None],
    ) -> None:
        """`served` (merged or starving requests) were picked over the FCFS batch: each
        request of the FCFS batch they displace gains its adapter one credit, and the
        served pay the total (shared evenly), so credit is conserved. Rows the starving
        leave free are filled from the FCFS batch (`chosen`); the filled requests still
        count as displaced (they lost their turn at the head of the order), so a
        starving adapter spends its credit and leaves the starving state even when its
        requests were in the FCFS batch themselves."""
        if not served:
            return
        cost = _displaced(fcfs, served)
        served_set = set(served)
        for item in fcfs:
            if item not in served_set:
                self.credits[kinds[item]] += 1
        for item in served:
            self.credits[kinds[item]] -= cost / len(served)

    # -- Algorithm 1 and the period bookkeeping of Algorithm 2 ---------------------------------

    def _run(
        self,
        chosen: Sequence[Item],
        fcfs: Sequence[Item],
        kinds: dict[Item, str | None],
        merged: str | None,
        reason: str,
        by_adapter: dict[str, list[Item]],
        served: Sequence[Item],
    ) -> Batch:
        self._transfer_credit(chosen, served, fcfs, kinds)
        candidate = merged or self._most_requested(by_adapter, set(by_adapter))
        if (
            merged != self.merged
            or candidate != self._candidate
            or len(self._period) >= (self.settings.period)
        ):
            self._break_point()
            self._period_merged = merged is not None
        self.merged = merged
        self._candidate = candidate
        merged_size = len(by_adapter.get(candidate, [])[: self.max_bs]) if candidate else 0
        self._period.append(_Iteration(merged_size, len(fcfs)))
        return Batch(tuple(chosen), merged, reason)

    @staticmethod
    def _most_requested(by_adapter: dict[str, list[Item]], eligible: set[str]) -> str | None:
        """The eligible adapter with the most runnable requests (ties: the earliest
        first request, since `by_adapter` is in FCFS order of first appearance)."""
        best, count = None, 0
        for adapter, items in by_adapter.items():
            if adapter in eligible and len(items) > count:
                best, count = adapter, len(items)
        return best

    # -- Algorithm 2 -------------------------------------------------------------------------

    def _break_point(self) -> None:
        period, switch = self._period, self._period_switch
        self._period, self._period_switch = [], 0.0
        if not self.tuned or not period:
            return
        throughputs = self.throughputs(period, merged_ran=self._period_merged, switch=switch)
        if throughputs is None:
            return
        merged_faster = throughputs[0] > throughputs[1]
        settings = self.settings
        if self._period_merged:
            self.beta = (
                self.beta - settings.gamma_dec
                if merged_faster
                else self.beta * (settings.gamma_mul)
            )
        else:
            self.alpha = (
                self.alpha - settings.gamma_dec
                if merged_faster
                else self.alpha * (settings.gamma_mul)
            )
            self.alpha = min(max(self.alpha, settings.min_alpha), settings.max_alpha)
        self.beta = min(max(self.beta, settings.min_beta), self.alpha - settings.hysteresis)
        self.counters["tunings"] += 1

    def throughputs(
        self, period: Sequence[_Iteration], *, merged_ran: bool, switch: float
    ) -> tuple[float, float] | None:
        """(T_merge, T_unmerge) of Algorithm 2, lines 4-5, over `period`: requests per
        second of iteration, the switch cost added to the merged side. The mode that ran
        is measured; the other predicted. None without the data to say."""
        merged_rows = fcfs_rows = 0
        merged_time = fcfs_time = 0.0
        for iteration in period:
            if iteration.seconds is None:
                continue
            merged_rows += iteration.merged_size
            fcfs_rows += iteration.fcfs_size
            if merged_ran:
                merged_time += iteration.seconds
                other = self.times.predict(False, iteration.fcfs_size)
            else:
                fcfs_time += iteration.seconds
                other = (
                    self.times.predict(True, iteration.merged_size) if iteration.merged_size else 0
                )
            if other is None:
                return None
            if merged_ran:
                fcfs_time += other
            else:
                merged_time += other
        if merged_rows == 0 or fcfs_time <= 0:
            return None
        switch_cost = switch if merged_ran else self.switch_seconds
        return merged_rows / (merged_time + switch_cost), fcfs_rows / fcfs_time
