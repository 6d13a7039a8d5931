"""SGMV: segmented LoRA for prefill (Punica), rows grouped by adapter into segments."""

from pallas_kernels.sgmv.kernel import check_sgmv_args, sgmv, sgmv_expand, sgmv_shrink
from pallas_kernels.sgmv.reference import sgmv_reference

__all__ = ["check_sgmv_args", "sgmv", "sgmv_expand", "sgmv_reference", "sgmv_shrink"]
