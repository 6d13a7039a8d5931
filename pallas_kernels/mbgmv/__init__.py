"""MBGMV (S-LoRA): decode rows apply their own adapters at their own ranks, from a page pool."""

from pallas_kernels.mbgmv.kernel import check_mbgmv_args, mbgmv, mbgmv_expand, mbgmv_shrink
from pallas_kernels.mbgmv.reference import mbgmv_reference

__all__ = ["check_mbgmv_args", "mbgmv", "mbgmv_expand", "mbgmv_reference", "mbgmv_shrink"]
