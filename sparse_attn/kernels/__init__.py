"""Skip-softmax (BLASST) paged attention kernels: a torch CPU implementation and a Triton
GPU kernel with the same tile geometry and skip rule (:mod:`._common`).

Kernels take a :class:`PagedBatch` (queries, logical ``[num_blocks, page_size, Hkv, D]``
K/V cache views with arbitrary strides, the block table and lengths, optionally their
host copy) and a :class:`LayerSpec` (what the layer computes), and never look at vLLM
versions or cache layouts.
"""

from ._common import SPLIT_K, TILE_K, TILE_Q
from .api import layer_launch, paged_attention, paged_attention_counts, step_args
from .batch import BatchMeta, LayerSpec, PagedBatch
from .checks import effective_lambda, never_skips
from .rule import LambdaRule
from .support import spec_for, unsupported

__all__ = ["SPLIT_K", "TILE_K", "TILE_Q", "BatchMeta", "LambdaRule", "LayerSpec", "PagedBatch", "effective_lambda",
           "layer_launch", "never_skips", "paged_attention", "paged_attention_counts", "spec_for", "step_args", "unsupported"]
