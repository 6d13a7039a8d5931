"""When does CPU assistance pay? A per-request estimate of the time to first token.

Beyond the papers (DESIGN.md, CPU-assisted LoRA): CaraServe always assists a cold
request; on a fast link the adapter lands before a CPU-assisted prefill would gain
anything, and the CPU path costs host callbacks per layer. So `auto` compares two
estimates, from numbers the engine measures (link bandwidth at start-up and per
transfer, the device prefill time per bucket, the CPU workers' start-up profile,
the callback round trip):

    wait:        load_left + prefill
    cpu-assist:  the prefill's layer-group segments in order; segment g starts at t,
                 and runs on the device (prefill · n_g / L) if group g has landed by
                 then (landed_g = load_left · layers up to g / L: every layer holds
                 the same bytes), else with
                 CPU LoRA, each layer taking max(prefill / L, cpu_layer + callbacks)
                 since the device's base projections overlap the CPU work; where
                 nothing overlaps it (`overlapped` false: the device is the CPU, whose
                 threads run both), prefill / L + cpu_layer + callbacks.

and picks the smaller. Each decision is logged with its estimates.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ColdStart:
    """What is known when a request for an adapter that is not resident is admitted.

    load_left_s: seconds until the whole adapter has landed on the device.
    prefill_s: the device prefill of the request's bucket, LoRA on the device.
    cpu_layer_s: CPU time of one layer's LoRA products for the prompt (workers split).
    callbacks_layer_s: host-callback and hand-off overhead of one CPU-routed layer.
    group_layers: layers per layer group, in order (they sum to the model's layers).
    overlapped: the CPU work runs while the device computes the base projections
      (`CpuAssist.overlapped`); false where the same cores compute both.
    """

    load_left_s: float
    prefill_s: float
    cpu_layer_s: float
    callbacks_layer_s: float
    group_layers: tuple[int, ...]
    overlapped: bool = True

    def __post_init__(self) -> None:
        for field in ("load_left_s", "prefill_s", "cpu_layer_s", "callbacks_layer_s"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"ColdStart.{field}={getattr(self, field)!r} must be >= 0")
        if not self.group_layers or min(self.group_layers) < 1:
            raise ValueError(f"ColdStart.group_layers={self.group_layers!r} must be positive")


@dataclasses.dataclass(frozen=True)
class Decision:
    assist: bool
    wait_s: float  # estimated time to first token when waiting for the load
    assist_s: float  # ... when prefilling now with CPU assistance

    def describe(self) -> str:
        choice = "cpu-assist" if self.assist else "wait for the load"
        return (
            f"{choice} (estimated TTFT: wait {1e3 * self.wait_s:.1f} ms, "
            f"cpu-assist {1e3 * self.assist_s:.1f} ms)"
        )


def wait_seconds(cold: ColdStart) -> float:
    return cold.load_left_s + cold.prefill_s


def assist_seconds(cold: ColdStart) -> float:
    layers = sum(cold.group_layers)
    device_layer = cold.prefill_s / layers
    cpu_work = cold.cpu_layer_s + cold.callbacks_layer_s
    cpu_layer = max(device_layer, cpu_work) if cold.overlapped else device_layer + cpu_work
    elapsed, landed_layers = 0.0, 0
    for size in cold.group_layers:
        landed_layers += size
        lands_at = cold.load_left_s * landed_layers / layers
        elapsed += size * (device_layer if elapsed >= lands_at else cpu_layer)
    return elapsed


def decide(cold: ColdStart) -> Decision:
    wait, assist = wait_seconds(cold), assist_seconds(cold)
    return Decision(assist < wait, wait, assist)
