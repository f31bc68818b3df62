"""One batch as the sparse path sees it: ``describe_batch(attn_metadata)`` ->
``BatchDescription``, normalised across backends and releases, with vLLM's host copies of the
batch lengths and the one phase rule. One description per step, shared by every layer.

Field names moved between releases and backends (FLASH_ATTN / CPU_ATTN carry the fields on
their own metadata; FlashInfer only in the common metadata its builder receives, captured by
``compat.model.capture_batches``; the host copies exist only there), so ``sparse_attn`` asks
here. vLLM is never imported.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

#: Metadata fields, per the names backends use (FlashAttention and CPU_ATTN
#: carry them on their own metadata; FlashInfer keeps them only in the common
#: metadata its builder receives, captured by ``capture_batches``).
_DIRECT_FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "num_actual_tokens", "max_query_len", "max_seq_len")
_CAPTURED_ATTR = "_sparse_attn_common"
#: Set on a builder class whose ``build`` met metadata it could not annotate.
_CAPTURE_FAILED_ATTR = "_sparse_attn_capture_failed"


# --------------------------------------------------------------------------- batches
@dataclass(frozen=True)
class PhaseRows:
    """The sequences of one phase in a batch, ready for one kernel launch.

    ``seqs``: their indices in the batch; ``rows``: their query rows (a slice when the
    sequences are adjacent, else an index tensor on the batch's device); ``block_table``
    ``[S', max_blocks]``, ``seq_lens`` ``[S']``, ``query_start_loc`` ``[S' + 1]`` (device);
    ``kv_lens`` / ``q_starts`` / ``q_lens``: the same lengths on the host (query offsets
    relative to the first of these rows); ``kv_lens`` is an upper bound unless ``kv_lens_exact``.
    """

    seqs: tuple[int, ...]
    rows: slice | torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_lens: tuple[int, ...]
    q_starts: tuple[int, ...]
    q_lens: tuple[int, ...]
    kv_lens_exact: bool = True


@dataclass(frozen=True)
class BatchDescription:
    """One attention launch, normalised across backends and releases.

    ``query_start_loc``: ``[S + 1]`` token offsets; ``seq_lens``: ``[S]`` KV
    lengths including this step's tokens; ``block_table``: ``[S, max_blocks]``;
    ``slot_mapping``: ``[num_tokens]``. ``num_tokens`` (tokens without padding),
    ``max_query_len`` and ``max_seq_len`` are host ints vLLM already has (no
    device read). ``native_only`` names why this launch must stay on the native
    path (cascade attention, non-causal or dynamic masks, metadata that could not
    be captured), or is ``None``.

    ``query_start_loc_host`` / ``seq_lens_host``: the copies of those on the host
    that vLLM already keeps (CommonAttentionMetadata's ``query_start_loc_cpu`` and
    ``seq_lens_cpu``, or from 0.32 only ``seq_lens_cpu_upper_bound``, exact except on
    async speculative-decode rows: ``seq_lens_host_exact`` says which), or the tensors
    themselves when the batch lives on the CPU; ``None`` where vLLM keeps none.

    One description serves every layer of a step: ``describe_batch`` keeps it on the
    metadata object vLLM builds per step and hands each layer of the KV-cache group,
    and ``host_lengths()`` / ``phase_rows()`` are computed once per description.
    vLLM's builders make a new metadata object per step in every release 0.15-0.33 (``build``
    constructs the dataclass), so a kept description never outlives its step.

    **The phase of a sequence** is decided here and nowhere else: a sequence is
    in the *decode* phase when its query length is exactly ``DECODE_QUERY_LEN``
    (1), otherwise *prefill*. Consequences, on purpose:

    * a speculative-decode verify step (query length k + 1) is *prefill*: its
      k + 1 query rows share a query tile, and the skip rule asks every row of a
      tile, which is how prefill launches were calibrated (one-row tiles skip
      more easily, so the decode fit would over-skip);
    * a 1-token final prefill chunk is *decode*: one query row at the last KV
      position is, for the kernel, exactly a decode step.

    ``uniform_decode`` (``max_query_len <= 1``, a host int) marks the batches
    vLLM captures in full CUDA graphs (the kernel itself tells a padded request, query
    length 0, from its query offsets there).
    """

    num_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    native_only: str | None
    query_start_loc_host: torch.Tensor | None = None
    seq_lens_host: torch.Tensor | None = None
    seq_lens_host_exact: bool = False
    #: per-description memo of host_lengths() / phase_rows() (one computation per step)
    _memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    DECODE_QUERY_LEN = 1

    @staticmethod
    def is_decode(query_len: int) -> bool:
        """The phase rule on a host query length (see the class docstring)."""
        return query_len == BatchDescription.DECODE_QUERY_LEN

    @property
    def uniform_decode(self) -> bool:
        """Every query length is at most 1 (0 = a padded or finished request)."""
        return int(self.max_query_len) <= self.DECODE_QUERY_LEN

    def host_lengths(self, exact: bool = True) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """``(query_start_loc, seq_lens, seq_lens_exact)`` as host ints, from vLLM's host copies
        (no device read). The query offsets are always exact; the KV lengths are exact when
        ``seq_lens_exact``, else an upper bound (``exact=False`` accepts vLLM's bound). What
        vLLM keeps no (acceptable) copy of is read from the device in one copy, once per step."""
        key = ("lengths", exact)
        if key not in self._memo:
            qsl, lens = self.query_start_loc_host, self.seq_lens_host
            lens_exact = self.seq_lens_host_exact
            if exact and not lens_exact:
                lens = None
            if qsl is None and lens is None:
                both = _read_device(torch.cat([self.query_start_loc.long(), self.seq_lens.long()]))
                qsl, lens, lens_exact = both[: self.query_start_loc.shape[0]], both[self.query_start_loc.shape[0]:], True
            elif qsl is None:
                qsl = _read_device(self.query_start_loc)
            elif lens is None:
                lens, lens_exact = _read_device(self.seq_lens), True
            self._memo[key] = (_as_ints(qsl), _as_ints(lens), lens_exact)
        return self._memo[key]

    def phase_rows(self, exact: bool = True) -> dict[str, PhaseRows]:
        """``{"decode" | "prefill": PhaseRows}`` of the sequences with query rows, by the
        phase rule; built once per step (one host -> device copy per phase whose sequences
        are not adjacent, none when they are), then shared by every layer. ``exact`` as
        ``host_lengths`` (the phases come from the exact query offsets either way)."""
        key = ("phases", exact)
        if key not in self._memo:
            starts, kv_lens, kv_exact = self.host_lengths(exact)
            groups: dict[str, list[int]] = {}
            for s in range(len(kv_lens)):
                q_len = starts[s + 1] - starts[s]
                if q_len:
                    groups.setdefault("decode" if self.is_decode(q_len) else "prefill", []).append(s)
            self._memo[key] = {phase: self._rows(seqs, starts, kv_lens, kv_exact) for phase, seqs in groups.items()}
        return self._memo[key]

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()``, once per step and ``key``: what a caller derives from this step's batch
        alone (the sparse path's per-(phase, policy) launch plan) is shared by every layer."""
        key = ("caller", key)
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def rows_of(self, seqs: tuple[int, ...], exact: bool = True) -> PhaseRows:
        """``PhaseRows`` of the sequences ``seqs`` (any subset with query rows), once per step."""
        key = ("rows", tuple(seqs), exact)
        if key not in self._memo:
            starts, kv_lens, kv_exact = self.host_lengths(exact)
            self._memo[key] = self._rows(list(seqs), starts, kv_lens, kv_exact)
        return self._memo[key]

    def _rows(self, seqs: list[int], starts: tuple[int, ...], kv_lens: tuple[int, ...], kv_exact: bool) -> PhaseRows:
        q_lens = tuple(starts[s + 1] - starts[s] for s in seqs)
        q_starts = tuple(itertools.accumulate(q_lens, initial=0))
        device = self.seq_lens.device
        first, last = seqs[0], seqs[-1]
        if seqs == list(range(first, last + 1)):
            rows: slice | torch.Tensor = slice(starts[first], starts[last + 1])
            block_table, seq_lens = self.block_table[first : last + 1], self.seq_lens[first : last + 1]
            query_start_loc = self.query_start_loc[first : last + 2] - self.query_start_loc[first : first + 1]
        else:
            index = torch.tensor(seqs, dtype=torch.long)
            row_index = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs])
            offsets = torch.tensor(q_starts, dtype=self.query_start_loc.dtype)
            # one host -> device copy for this phase and step (non_blocking from pinned memory on GPU)
            packed = _to_device(torch.cat([index, row_index, offsets.long()]), device)
            index, rows, query_start_loc = packed[: len(seqs)], packed[len(seqs): len(seqs) + len(row_index)], \
                packed[len(seqs) + len(row_index):].to(self.query_start_loc.dtype)
            block_table, seq_lens = self.block_table[index], self.seq_lens[index]
        return PhaseRows(tuple(seqs), rows, block_table, seq_lens, query_start_loc,
                         tuple(kv_lens[s] for s in seqs), q_starts[:-1], q_lens, kv_exact)


def _read_device(tensor: torch.Tensor) -> torch.Tensor:
    """The one device -> host read of batch lengths a step may need (vLLM kept no exact host copy)."""
    return tensor.cpu()


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return tensor
    pinned = tensor.pin_memory() if torch.cuda.is_available() else tensor
    return pinned.to(device, non_blocking=True)


def _as_ints(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(v) for v in tensor.tolist())


#: On a metadata object: its BatchDescription, so the layers of one step share one.
_BATCH_ATTR = "_sparse_attn_batch"
#: Host copies of the batch in CommonAttentionMetadata: (query offsets, exact KV lengths,
#: KV-length upper bound). 0.32 has only the upper bound; tests/matrix/test_layer_features.py.
_HOST_FIELDS = ("query_start_loc_cpu", "seq_lens_cpu", "seq_lens_cpu_upper_bound")


def describe_batch(attn_metadata: Any) -> BatchDescription:
    """Normalise a backend's attention metadata into a ``BatchDescription``, once per step.

    The description is kept on ``attn_metadata`` (vLLM's builders make a new metadata
    object every step and hand the same one to every layer of a KV-cache group), so the
    layers of a step share one, with its host lengths and phase rows.
    Never raises for a launch: metadata that is neither captured nor carries the
    fields gives ``native_only`` (``prepare_layer`` refuses such layers up front).
    """
    cached = getattr(attn_metadata, _BATCH_ATTR, None)
    if isinstance(cached, BatchDescription):
        return cached
    description = _describe(attn_metadata)
    try:
        object.__setattr__(attn_metadata, _BATCH_ATTR, description)
    except (AttributeError, TypeError):  # slotted metadata: described again by the next layer
        pass
    return description


def _host_copies(common: Any, fields: dict) -> dict:
    if fields["seq_lens"].device.type == "cpu" and fields["query_start_loc"].device.type == "cpu":
        return dict(query_start_loc_host=fields["query_start_loc"], seq_lens_host=fields["seq_lens"], seq_lens_host_exact=True)
    if common is None:
        return {}
    qsl, exact, bound = (getattr(common, name, None) for name in _HOST_FIELDS)
    lens = exact if exact is not None else bound
    return dict(query_start_loc_host=qsl, seq_lens_host=lens, seq_lens_host_exact=exact is not None)


def _describe(attn_metadata: Any) -> BatchDescription:
    captured = getattr(attn_metadata, _CAPTURED_ATTR, None)
    native_only = None
    common = None
    if getattr(attn_metadata, "use_cascade", False):
        native_only = "cascade attention"
    if captured is not None:
        prefix_len, common = captured
        if prefix_len:
            native_only = native_only or "shared-prefix (cascade) launch"
        causal = common.causal
        fields = dict(
            query_start_loc=common.query_start_loc, seq_lens=common.seq_lens, block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping, num_tokens=common.num_actual_tokens, max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
        )
    else:
        missing = [f for f in _DIRECT_FIELDS if not hasattr(attn_metadata, f)]
        if missing:
            empty = torch.empty(0, dtype=torch.int32)
            return BatchDescription(
                num_tokens=0, query_start_loc=empty, seq_lens=empty, block_table=empty.view(0, 0), slot_mapping=empty,
                max_query_len=0, max_seq_len=0,
                native_only=f"{type(attn_metadata).__name__} has no {', '.join(missing)} and its builder was not captured",
            )
        causal = getattr(attn_metadata, "causal", True)
        fields = dict(
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens, block_table=attn_metadata.block_table,
            slot_mapping=attn_metadata.slot_mapping, num_tokens=attn_metadata.num_actual_tokens,
            max_query_len=attn_metadata.max_query_len, max_seq_len=attn_metadata.max_seq_len,
        )
    if isinstance(causal, torch.Tensor) or getattr(attn_metadata, "dynamic_causal", None) is not None:
        native_only = native_only or "per-token (dynamic) causal mask"
    elif not causal:
        native_only = native_only or "non-causal attention"
    return BatchDescription(native_only=native_only, **fields, **_host_copies(common, fields))
