"""BGMV: Punica's batched gather matrix-vector LoRA kernel over stacked adapter slots."""

from pallas_kernels.bgmv.kernel import batch_rank, bgmv, bgmv_expand, bgmv_shrink, check_bgmv_args
from pallas_kernels.bgmv.reference import bgmv_reference

__all__ = ["batch_rank", "bgmv", "bgmv_expand", "bgmv_reference", "bgmv_shrink", "check_bgmv_args"]
