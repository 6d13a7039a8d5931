"""Paged decode attention: one new token per sequence over its cached blocks, GQA-aware."""

from pallas_kernels.decode_attention.kernel import check_decode_attention_args, decode_attention
from pallas_kernels.decode_attention.reference import decode_attention_reference

__all__ = ["check_decode_attention_args", "decode_attention", "decode_attention_reference"]
