"""The Llama projections a LoRA adapter may target, and their shapes in a base model."""

from __future__ import annotations

from configs import ModelConfig
from configs.engine import LORA_TARGETS as TARGETS

__all__ = ["INPUT_GROUPS", "TARGETS", "rank_row_bytes", "target_shapes"]

# The projections that read one input, in the order a layer runs them: q/k/v read the
# normed attention input, gate/up the normed MLP input. CPU-assisted prefill hands each
# group's input to the CPU workers once (CaraServe §4.2).
INPUT_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
)


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of `config`."""
    d, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (d, config.q_size),
        "k_proj": (d, config.kv_size),
        "v_proj": (d, config.kv_size),
        "o_proj": (config.q_size, d),
        "gate_proj": (d, i),
        "up_proj": (d, i),
        "down_proj": (i, d),
    }


def rank_row_bytes(
    shapes: dict[str, tuple[int, int]], targets: tuple[str, ...], num_layers: int, itemsize: int
) -> int:
    """The device bytes of one rank of an adapter on `targets`: A's column and B's row of
    each target (in_features + out_features), in every layer."""
    return num_layers * itemsize * sum(sum(shapes[target]) for target in targets)
