"""What the worker's and the router's metrics share, so their /metrics can be compared
and summed: the histogram buckets, and the outcome labels of a Generate call."""

from jlora.contract.errors import Code

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)

# The `outcome` label of a Generate call: its finish reason, or how it failed.
OUTCOMES = (
    "stop",
    "length",
    "cancelled",  # the client cancelled (its request is aborted in the engine)
    "deadline",
    "invalid",
    "not_found",
    "exhausted",
    "unavailable",
    "error",
)
_FAILED = {
    Code.INVALID_ARGUMENT: "invalid",
    Code.ALREADY_EXISTS: "invalid",
    Code.NOT_FOUND: "not_found",
    Code.RESOURCE_EXHAUSTED: "exhausted",
    Code.UNAVAILABLE: "unavailable",
    Code.DEADLINE_EXCEEDED: "deadline",
    Code.CANCELLED: "cancelled",
}


def failed_outcome(code: Code) -> str:
    """The outcome label of a call that ended with `code`."""
    return _FAILED.get(code, "error")
