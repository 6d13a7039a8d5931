"""What a submit may ask of the pool: its input and its jobs, checked against the
control block's layout and the arena (ValueError naming the field), and what every call
of the same jobs needs, worked out once (`CheckedJobs`): a prefill makes the same calls,
one per layer and input group, for every prompt of an adapter.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from cpu_offload.protocol import MAX_JOBS, Layout, LoraJob, Task

# The most checked submits `_jobs` keeps: a prefill's layers and input groups for many
# adapters (30 layers x 3 groups each for SmolLM2).
CHECKED_JOBS_KEPT = 4096


@dataclasses.dataclass(frozen=True)
class CheckedJobs:
    """A submit's jobs checked against the arena and its output (`JobChecker.jobs`),
    with what each call of them needs worked out once: a prefill makes the same calls,
    one per layer and input group, for every prompt of an adapter."""

    whole: Task  # every row of a submit: rows [0, its rows), set per call
    gaps: tuple[tuple[int, int], ...]  # the output's column ranges no job writes
    flops_per_token: int
    job_rows: np.ndarray  # whole.job_rows(), the kernels' descriptor


class JobChecker:
    """Checks a pool's submits (`layout`: its control block's; `arena_nbytes`: the arena
    the jobs' offsets point into), remembering the jobs it has checked."""

    def __init__(self, layout: Layout, arena_nbytes: int) -> None:
        self.layout = layout
        self.arena_nbytes = arena_nbytes
        self._checked: dict[tuple, CheckedJobs] = {}

    def jobs(
        self,
        jobs: tuple[LoraJob, ...],
        in_features: int,
        columns: Sequence[int] | None,
        out_total: int | None,
    ) -> CheckedJobs:
        """The jobs of a submit, checked, or found among those checked before (that
        skips about a fifth of a small product's time in Python checks)."""
        key: tuple | None = (
            in_features,
            jobs,
            None if columns is None else tuple(columns),
            out_total,
        )
        try:
            found = self._checked.get(key)  # type: ignore[arg-type]
        except TypeError:  # unhashable, so not valid: the checks below say why
            key, found = None, None
        if found is not None:
            return found
        self._check_jobs(jobs, in_features)
        columns, out_total, gaps = self._check_columns(jobs, columns, out_total)
        whole = Task(0, 0, in_features, out_total, jobs, columns)
        checked = CheckedJobs(
            whole,
            gaps,
            sum(2 * job.rank * (in_features + job.out_features) for job in jobs),
            whole.job_rows(),
        )
        if key is not None:
            if len(self._checked) >= CHECKED_JOBS_KEPT:
                self._checked.clear()
            self._checked[key] = checked
        return checked

    def input(self, x: object) -> tuple[int, int]:
        if not isinstance(x, np.ndarray) or x.dtype != np.float32:
            raise ValueError(f"x.dtype={getattr(x, 'dtype', type(x))} must be float32 ndarray")
        if x.ndim != 2:
            raise ValueError(f"x.shape={x.shape} must be [rows, in_features]")
        rows, in_features = x.shape
        if not 1 <= rows <= self.layout.max_rows:
            raise ValueError(f"rows={rows} must be in 1..max_rows={self.layout.max_rows}")
        if not 1 <= in_features <= self.layout.max_in:
            raise ValueError(f"in_features={in_features} must be in 1..max_in={self.layout.max_in}")
        return rows, in_features

    def _check_jobs(self, jobs: tuple[LoraJob, ...], in_features: int) -> None:
        if not 1 <= len(jobs) <= MAX_JOBS:
            raise ValueError(f"len(jobs)={len(jobs)} must be in 1..{MAX_JOBS}")
        for job in jobs:
            if not isinstance(job, LoraJob):
                raise ValueError(f"jobs: {job!r} is not a LoraJob")
            if job.rank < 1 or job.out_features < 1:
                raise ValueError(f"{job.rank=} and {job.out_features=} must be positive")
            for field, offset, count in [
                ("a_offset", job.a_offset, in_features * job.rank),
                ("b_offset", job.b_offset, job.rank * job.out_features),
            ]:
                if offset < 0 or offset % 4 or offset + 4 * count > self.arena_nbytes:
                    raise ValueError(
                        f"{field}={offset} ({4 * count} bytes) must be a multiple of 4 "
                        f"inside the arena ({self.arena_nbytes} bytes)"
                    )

    def _check_columns(
        self, jobs: tuple[LoraJob, ...], columns: Sequence[int] | None, out_total: int | None
    ) -> tuple[tuple[int, ...], int, tuple[tuple[int, int], ...]]:
        """(columns, out_total, gaps) of a submit: every job's columns inside the output,
        none overlapping; gaps are the column ranges no job covers."""
        if columns is None:
            widths = (job.out_features for job in jobs[:-1])
            columns = tuple(itertools.accumulate(widths, initial=0))
        columns = tuple(int(column) for column in columns)
        if len(columns) != len(jobs):
            raise ValueError(f"len(columns)={len(columns)} must equal len(jobs)={len(jobs)}")
        spans = sorted(
            (column, column + job.out_features) for column, job in zip(columns, jobs, strict=True)
        )
        if out_total is None:
            out_total = spans[-1][1]
        if not 1 <= out_total <= self.layout.max_out:
            raise ValueError(
                f"out_total={out_total} (by default the jobs' out_features side by side) "
                f"must be in 1..max_out={self.layout.max_out}"
            )
        gaps, cursor = [], 0
        for start, stop in spans:
            if start < cursor or stop > out_total:
                raise ValueError(
                    f"columns={columns}: job columns [{start}, {stop}) overlap another job's "
                    f"or leave the output (out_total={out_total})"
                )
            if start > cursor:
                gaps.append((cursor, start))
            cursor = stop
        if cursor < out_total:
            gaps.append((cursor, out_total))
        return columns, out_total, tuple(gaps)
