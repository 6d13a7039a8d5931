"""The papers' linear performance models: predicted latency of one iteration of a batch.

Toppings §5 ("Performance modeling", Eq. 2; CaraServe §5 is the same) observes that the
LoRA kernels are bound by memory bandwidth spent moving adapter weights, so the latency
of an iteration is linear in one number computed from the batch's ranks:

    Perf_BGMV(S)  = α_B · |S| · max_{i∈S} rank(i) + β_B     (Punica pads to the max rank)
    Perf_MBGMV(S) = α_M · Σ_{i∈S} rank(i)        + β_M     (S-LoRA reads each own rank)

α and β are fitted by least squares on profiled iterations of the worker's own hardware
(`jlora profile` writes them, with R², into the JSON file `PerfProfile.load` reads) and
the rank-aware router (`router.policies`) evaluates them for hypothetical batches.

Prefill. The paper gives Eq. 2 for decoding and reuses the same form for PrePerf without
saying what |S| is. A LoRA kernel's rows are tokens, not requests: a decode step gives
each request one row, a prefill gives it its whole prompt. So a batch here is a list of
requests, each with a rank and a token count (1 in a decode step), and the rank feature
counts rows:

    bgmv:  (Σ_i tokens_i) · max_i rank_i      mbgmv:  Σ_i tokens_i · rank_i

which is exactly Eq. 2 when every request has one token. A prefill also pays for the
base model's compute-bound matmuls in proportion to its tokens whatever the ranks, and a
rank-only model would charge a long rank-8 prompt almost nothing. Prefill models
therefore add one term, γ · Σ_i tokens_i (jlora's choice, not the paper's); decode
models keep Eq. 2 exactly (γ = 0). Rank 0 is a request without an adapter.

An empty batch costs 0, not β: no iteration runs. Algorithm 1's Δprefill for a request
arriving at an empty queue is then a whole prefill iteration, as it should be.

Times are milliseconds throughout.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast, get_args

import numpy as np

Kind = Literal["bgmv", "mbgmv"]
KINDS: tuple[str, ...] = get_args(Kind)
FORMAT = "jlora-perf-profile"
FORMAT_VERSION = 1


class ProfileError(ValueError):
    """A performance model or profile is invalid; the message names the field.

    `field` is the dotted name of the bad value (for example "decode.alpha").
    """

    def __init__(self, field: str, value: object, reason: str, source: str = "") -> None:
        self.field, self.value, self.reason, self.source = field, value, reason, source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}={value!r}: {reason}")

    def within(self, prefix: str, source: str = "") -> ProfileError:
        """The same error, its field qualified by `prefix` (and located in `source`)."""
        field = f"{prefix}.{self.field}" if self.field else prefix
        return ProfileError(field, self.value, self.reason, source)


def rank_feature(kind: str, ranks: Sequence[int], tokens: Sequence[int] | None = None) -> float:
    """Eq. 2's batch term: the rows the LoRA kernel processes, times the rank it reads.

    ranks: int[n] >= 0, one per request (0: no adapter). tokens: int[n] >= 1, the rows
    each request contributes (its prompt in a prefill); None means 1 each (a decode step).
    bgmv: Σ tokens · max rank (padding to the batch's maximum); mbgmv: Σ tokens·rank.
    """
    rows = _rows(ranks, tokens)
    if kind == "bgmv":
        return float(sum(rows) * max(ranks, default=0))
    if kind == "mbgmv":
        return float(sum(r * t for r, t in zip(ranks, rows, strict=True)))
    raise ProfileError("kind", kind, f"must be one of {KINDS}")


@dataclasses.dataclass(frozen=True)
class PerfModel:
    """A fitted model: latency_ms = alpha · rank_feature + gamma · Σ tokens + beta.

    kind: "bgmv" or "mbgmv", which form of Eq. 2 (see `rank_feature`). alpha: ms per
    row·rank, >= 0. beta: ms, the fixed cost of an iteration. gamma: ms per token, >= 0,
    fitted for prefill models only (0 for decode, which is then Eq. 2 exactly). r2: the
    fit's coefficient of determination on its samples (1 is a perfect fit), <= 1.
    n_samples: how many profiled iterations it was fitted on. A model written by hand
    (from a paper's numbers, in a test) has r2 None and n_samples 0.
    """

    kind: Kind
    alpha: float
    beta: float
    gamma: float = 0.0
    r2: float | None = None
    n_samples: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ProfileError("kind", self.kind, f"must be one of {KINDS}")
        for field in ("alpha", "beta", "gamma", "r2"):
            value = getattr(self, field)
            if field == "r2" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ProfileError(field, value, "must be a number")
            if not math.isfinite(value):
                raise ProfileError(field, value, "must be finite")
            object.__setattr__(self, field, float(value))
        for field in ("alpha", "gamma"):
            if getattr(self, field) < 0:
                raise ProfileError(field, getattr(self, field), "must be >= 0")
        if self.r2 is not None and self.r2 > 1.0:
            raise ProfileError("r2", self.r2, "must be <= 1")
        if isinstance(self.n_samples, bool) or not isinstance(self.n_samples, int):
            raise ProfileError("n_samples", self.n_samples, "must be an integer")
        if self.n_samples < 0:
            raise ProfileError("n_samples", self.n_samples, "must be >= 0")
        if (self.r2 is None) != (self.n_samples == 0):
            raise ProfileError(
                "n_samples", self.n_samples, f"a fitted model has both; r2={self.r2!r}"
            )

    def predict(self, ranks: Sequence[int], tokens: Sequence[int] | None = None) -> float:
        """Predicted latency (ms) of one iteration over the batch; 0 for an empty batch.

        ranks, tokens: as in `rank_feature` (tokens None: a decode step).
        """
        if not ranks:
            return 0.0
        if tokens is None:  # a decode step: `rank_feature` with one row each, without lists
            count = len(ranks)
            feature = count * max(ranks) if self.kind == "bgmv" else sum(ranks)
            return self.alpha * float(feature) + self.gamma * count + self.beta
        rows = _rows(ranks, tokens)
        return (
            self.alpha * rank_feature(self.kind, ranks, rows) + self.gamma * sum(rows) + self.beta
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: object) -> PerfModel:
        """The model `to_json` wrote; ProfileError names the bad or missing field."""
        if not isinstance(data, Mapping):
            raise ProfileError("", data, "must be a JSON object")
        names = [f.name for f in dataclasses.fields(cls)]
        for name in data:
            if name not in names:
                raise ProfileError(str(name), data[name], f"unknown field; expected {names}")
        for name in names:
            if name not in data:
                raise ProfileError(name, None, "is missing")
        return cls(**data)


def fit(
    kind: str,
    batches: Sequence[Sequence[int]],
    times_ms: Sequence[float],
    *,
    tokens: Sequence[Sequence[int]] | None = None,
) -> PerfModel:
    """Least-squares fit of a `PerfModel` to profiled iterations, with its R².

    batches: the ranks of each profiled batch (int[n_i] >= 0, non-empty). times_ms: the
    measured latency of each, finite and >= 0. tokens: for a prefill model, the tokens of
    each request (same shape as batches, each >= 1); the fit then also has the per-token
    term γ. Omitted: a decode model, Eq. 2 exactly (γ = 0).

    The slopes are constrained to be >= 0 (a profile with no visible rank dependence,
    for example on a CPU, gives α = 0 rather than a negative cost for adapters): every
    subset of the slopes is fitted freely with β, and the feasible fit with the least
    squared error is kept, which is the exact non-negative least-squares solution for
    two slopes. R² = 1 - SS_res / SS_tot, and 1 when all times are equal.
    """
    if kind not in KINDS:
        raise ProfileError("kind", kind, f"must be one of {KINDS}")
    if len(batches) != len(times_ms):
        raise ProfileError(
            "times_ms", f"{len(times_ms)} values", f"must match batches ({len(batches)})"
        )
    if tokens is not None and len(tokens) != len(batches):
        raise ProfileError("tokens", f"{len(tokens)} rows", f"must match batches ({len(batches)})")
    for i, batch in enumerate(batches):
        if not batch or not all(_is_int(r) and r >= 0 for r in batch):
            raise ProfileError(f"batches[{i}]", list(batch), "must be ranks >= 0, at least one")
        if tokens is not None and (
            len(tokens[i]) != len(batch) or not all(_is_int(t) and t >= 1 for t in tokens[i])
        ):
            raise ProfileError(
                f"tokens[{i}]", list(tokens[i]), f"must be {len(batch)} token counts >= 1"
            )
    times = np.asarray(times_ms, dtype=np.float64)
    if times.ndim != 1 or not np.all(np.isfinite(times)) or np.any(times < 0):
        raise ProfileError("times_ms", list(times_ms), "must be finite numbers >= 0")
    per_request = [None] * len(batches) if tokens is None else list(tokens)
    features = [[rank_feature(kind, b, t) for b, t in zip(batches, per_request, strict=True)]]
    names = ["alpha"]
    if tokens is not None:
        features.append([float(sum(_rows(b, t))) for b, t in zip(batches, tokens, strict=True)])
        names.append("gamma")
    slopes = np.asarray(features, dtype=np.float64).T  # [n_samples, n_slopes]
    if len(times) < slopes.shape[1] + 2:
        raise ProfileError(
            "batches", f"{len(times)} samples", f"need at least {slopes.shape[1] + 2} to fit"
        )
    full = np.column_stack([slopes, np.ones(len(times))])
    if np.linalg.matrix_rank(full) < full.shape[1]:
        raise ProfileError(
            "batches",
            f"{len(times)} samples",
            "do not vary enough to separate "
            + ", ".join([*names, "beta"])
            + " (profile several batch sizes and ranks"
            + (", and several ranks at the same token count)" if tokens is not None else ")"),
        )
    coefficients, residual = _nonnegative_slopes(slopes, times)
    total = float(np.sum((times - times.mean()) ** 2))
    r2 = 1.0 - residual / total if total > 0 else 1.0
    values = dict(zip(names, coefficients[:-1], strict=True))
    return PerfModel(
        kind=cast(Kind, kind),
        alpha=float(values["alpha"]),
        beta=float(coefficients[-1]),
        gamma=float(values.get("gamma", 0.0)),
        r2=min(r2, 1.0),
        n_samples=len(times),
    )


@dataclasses.dataclass(frozen=True)
class PerfProfile:
    """The prefill and decode models of one worker's hardware, as `jlora profile` fits them.

    device and base_model say what was profiled (informational: the α and β of one GPU
    and model do not carry over to another, Toppings §5).
    """

    prefill: PerfModel
    decode: PerfModel
    device: str = ""
    base_model: str = ""

    def __post_init__(self) -> None:
        for field in ("prefill", "decode"):
            if not isinstance(getattr(self, field), PerfModel):
                raise ProfileError(field, getattr(self, field), "must be a PerfModel")
        for field in ("device", "base_model"):
            if not isinstance(getattr(self, field), str):
                raise ProfileError(field, getattr(self, field), "must be a string")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "device": self.device,
            "base_model": self.base_model,
            "prefill": self.prefill.to_json(),
            "decode": self.decode.to_json(),
        }

    @classmethod
    def from_json(cls, data: object, source: str = "") -> PerfProfile:
        """The profile `to_json` wrote; ProfileError names the field (and `source`)."""
        if not isinstance(data, Mapping):
            raise ProfileError("profile", data, "must be a JSON object", source)
        expected = ("format", "version", "device", "base_model", "prefill", "decode")
        for name in data:
            if name not in expected:
                raise ProfileError(
                    str(name), data[name], f"unknown field; expected {expected}", source
                )
        for name in expected:
            if name not in data:
                raise ProfileError(name, None, "is missing", source)
        if data["format"] != FORMAT:
            raise ProfileError("format", data["format"], f"must be {FORMAT!r}", source)
        if data["version"] != FORMAT_VERSION:
            raise ProfileError(
                "version",
                data["version"],
                f"this jlora reads version {FORMAT_VERSION} (re-run `jlora profile`)",
                source,
            )
        models = {}
        for phase in ("prefill", "decode"):
            try:
                models[phase] = PerfModel.from_json(data[phase])
            except ProfileError as err:
                raise err.within(phase, source) from None
        try:
            return cls(device=data["device"], base_model=data["base_model"], **models)
        except ProfileError as err:
            raise ProfileError(err.field, err.value, err.reason, source) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PerfProfile:
        """Read and validate a profile file; ProfileError names the file and the field."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ProfileError("<file>", str(path), f"cannot read it as JSON ({err})") from err
        return cls.from_json(data, source=str(path))


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _rows(ranks: Sequence[int], tokens: Sequence[int] | None) -> Sequence[int]:
    """Each request's kernel rows: its tokens, or 1 each in a decode step."""
    if tokens is None:
        return [1] * len(ranks)
    if len(tokens) != len(ranks):
        raise ProfileError("tokens", list(tokens), f"must have one entry per rank ({len(ranks)})")
    return tokens


def _nonnegative_slopes(slopes: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, float]:
    """[slope..., intercept] minimising ||slopes·s + b - times||² subject to s >= 0, and the
    residual sum of squares: the best feasible fit over every subset of free slopes."""
    n_samples, n_slopes = slopes.shape
    best: tuple[np.ndarray, float] | None = None
    for mask in range(1 << n_slopes):
        free = [j for j in range(n_slopes) if mask >> j & 1]
        design = np.column_stack([slopes[:, free], np.ones(n_samples)])
        solution = np.linalg.lstsq(design, times, rcond=None)[0]
        if np.any(solution[:-1] < 0):
            continue
        coefficients = np.zeros(n_slopes + 1)
        coefficients[free] = solution[:-1]
        coefficients[-1] = solution[-1]
        residual = float(np.sum((design @ solution - times) ** 2))
        if best is None or residual < best[1]:
            best = (coefficients, residual)
    assert best is not None  # the empty subset (intercept only) is always feasible
    return best
