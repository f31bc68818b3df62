"""Skip-softmax (BLASST) paged attention kernels: a torch CPU implementation and a Triton
GPU kernel with the same tile geometry and skip rule.

Kernels take logical ``[num_blocks, page_size, Hkv, D]`` K/V cache views with arbitrary
strides and never look at vLLM versions or cache layouts.
"""

from ._common import SPLIT_K, TILE_K, TILE_Q
from .api import paged_attention, paged_attention_counts

__all__ = ["SPLIT_K", "TILE_K", "TILE_Q", "paged_attention", "paged_attention_counts"]
