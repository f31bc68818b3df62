"""What a kernel call is given: the paged batch of one step and the layer it computes.

Both are frozen dataclasses built by the caller (the serving adapter builds a
:class:`LayerSpec` once per layer and a :class:`PagedBatch` per launch); every
implementation (torch, Triton, the C++ CPU kernel) reads them and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


def _ints(values, name: str) -> tuple[int, ...]:
    """A host sequence or a CPU tensor of token counts as a tuple of Python ints."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"BatchMeta.from_host: {name} is on {values.device}, expected a host copy "
                             f"(a list or a CPU tensor; reading a device tensor here would stall the stream)")
        values = values.tolist()
    try:
        return tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"BatchMeta.from_host: {name} must be integers, got {values!r}") from None


@dataclass(frozen=True)
class BatchMeta:
    """Host copy of a batch's lengths: one Python int per sequence, in tokens.

    ``seq_lens[s]`` is sequence ``s``'s KV length (this step's tokens included),
    ``q_starts[s]`` its first query row, ``q_lens[s]`` its number of query rows.
    Build it with :meth:`from_host` from the host copies a serving engine already keeps
    (vLLM: ``query_start_loc_cpu``, ``seq_lens_cpu``); it must describe the same batch as
    the device tensors of the :class:`PagedBatch` it travels in.  ``q_starts`` / ``q_lens``
    are exact; ``seq_lens_exact=False`` says ``seq_lens`` are upper bounds (vLLM 0.32's
    ``seq_lens_cpu_upper_bound`` under asynchronous speculative decoding): kernels then
    size their grids from them but take every length that decides a mask, a tile or a
    count from the device ``seq_lens``.
    """

    seq_lens: tuple[int, ...]
    q_starts: tuple[int, ...]
    q_lens: tuple[int, ...]
    seq_lens_exact: bool = True
    #: launch state derived from these lengths alone (the Triton tile map), built by the first
    #: launch that travels with this host copy and reused by the next: a caller that keeps one
    #: ``BatchMeta`` per step (the serving path's step plan) builds it once per step, not per layer
    memo: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @classmethod
    def from_host(cls, seq_lens: Sequence[int] | torch.Tensor, query_start_loc: Sequence[int] | torch.Tensor,
                  *, seq_lens_exact: bool = True) -> "BatchMeta":
        """From ``seq_lens`` ``[S]`` and ``query_start_loc`` ``[S + 1]`` (lists or CPU tensors)."""
        lens, qsl = _ints(seq_lens, "seq_lens"), _ints(query_start_loc, "query_start_loc")
        if len(qsl) != len(lens) + 1:
            raise ValueError(f"BatchMeta.from_host: query_start_loc has {len(qsl)} entries, expected "
                             f"len(seq_lens) + 1 = {len(lens) + 1}")
        return cls(lens, qsl[:-1], tuple(b - a for a, b in zip(qsl[:-1], qsl[1:])), bool(seq_lens_exact))

    @property
    def num_tokens(self) -> int:
        return self.q_starts[-1] + self.q_lens[-1] if self.q_lens else 0


@dataclass(frozen=True)
class PagedBatch:
    """One launch's queries and paged KV cache.

    ``query``: ``[T, Hq, D]``, the query tokens of all sequences concatenated.
    ``key_cache`` / ``value_cache``: logical ``[num_blocks, page_size, Hkv, D]`` views with
    any strides (read in place through the block table, never made contiguous); the
    query's dtype, or ``float8_e4m3fn`` / ``float8_e5m2`` (an fp8 cache; see
    :class:`LayerSpec` for its scales).
    ``block_table``: ``[S, max_blocks]`` int32/int64 cache block ids per sequence.
    ``seq_lens``: ``[S]`` int32/int64 KV length per sequence, this step's tokens included
    (already written to the cache).
    ``query_start_loc``: ``[S + 1]`` int32/int64 cumulative query offsets: sequence ``s``
    owns query rows ``query_start_loc[s]:query_start_loc[s+1]``, its LAST ``q_len`` KV
    positions (query row ``i`` sits at position ``kv_len - q_len + i``).
    ``host``: the same lengths on the host (:class:`BatchMeta`), or ``None``.  With it a
    call reads no device data on the host (the grid is exact and validation uses it);
    without it a checked call copies ``seq_lens`` / ``query_start_loc`` to the host once.
    ``max_query_len``: a host upper bound on every query length, read only by an
    unchecked call without ``host`` (default ``T``); 1 selects the split-KV decode launch.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    host: BatchMeta | None = None
    max_query_len: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[2]

    @property
    def head_dim(self) -> int:
        return self.query.shape[2]

    @property
    def page_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def group(self) -> int:
        """Query heads per KV head: query head ``h`` reads KV head ``h // group``."""
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer computes, independent of the batch (build it once per layer).

    ``scale``: softmax scale applied to ``q . k`` (logits per dot-product unit).
    ``causal``: a query row at position ``p`` sees KV positions ``<= p``; ``False``: all
    ``kv_len`` positions.
    ``window``: ``w`` tokens or ``None``: a row at position ``p`` sees only
    ``[p - w + 1, p]`` (needs ``causal``; vLLM's ``(w - 1, 0)`` window is ``w``).
    ``soft_cap``: ``cap`` or ``None``: logits become ``cap * tanh(logit / cap)``
    (Gemma 2's 50.0) before the skip test and the softmax.
    ``sink_logits``: ``[Hq]`` float tensor on the query's device, or ``None``: one learned logit
    per query head added to the softmax denominator only (gpt-oss: ``p_j = exp(s_j) /
    (sum_k exp(s_k) + exp(sink_h))``); it has no value and never enters the skip test.
    ``k_scale`` / ``v_scale``: per-tensor dequantisation scales of an fp8 cache (a float,
    or a 1-element float tensor on the query's device, read only inside the kernels, so a
    captured graph sees in-place updates): logits use ``scale * k_scale * q . k_fp8``,
    outputs are multiplied by ``v_scale``.  Applied for any cache dtype; unquantised
    caches use the default 1.0.
    """

    scale: float
    causal: bool = True
    window: int | None = None
    soft_cap: float | None = None
    sink_logits: torch.Tensor | None = None
    k_scale: float | torch.Tensor = 1.0
    v_scale: float | torch.Tensor = 1.0


#: Where a launch adds its counts in a ``counters`` tensor (int64, the serving stats' device
#: counter of a (phase, device), ``sparse_attn.protocol.PHASE_COUNTERS`` order): tiles skipped
#: and visited by sequences with lambda > 0, and one sparse launch (some lambda > 0 on a
#: sequence with query rows) or one dense launch; and, from the kernels that add their counts themselves
#: (``COUNTS_IN_KERNEL``: Triton, the compiled CPU kernel), the (KV head, tile) pairs tested and those whose V
#: no query head read.
COUNTER_SLOTS = {"skipped": 0, "visited": 1, "launches": 2, "dense_launches": 4, "v_tested": 5, "v_skipped": 6}
