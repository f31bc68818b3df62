"""Reading whole KV tiles of a paged cache through the block table (the torch implementation).

Gathers go into buffers kept across calls, and K/V are consumed in cache-sized runs of
sequences (:func:`sub_batches`); an fp8 cache is gathered as stored and converted to fp32
after the gather (one pass over the tiles actually read).
"""

from __future__ import annotations

import math
import threading

import torch

from ._common import TILE_K

# K/V are read and consumed in runs of at most this many elements (2 MiB fp32), so the
# matmul reads them from cache rather than from memory.
SUB_BUDGET = 1 << 19

# Gather buffers, kept across calls (per thread): a fresh multi-MiB buffer per call would
# be page-faulted in again every call, which costs as much as the gather itself.
_BUFFERS = threading.local()


def buffer(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    key = (name, dtype)
    buf = getattr(_BUFFERS, "pool", None)
    if buf is None:
        buf = _BUFFERS.pool = {}
    t = buf.get(key)
    if t is None or t.numel() < numel:
        t = buf[key] = torch.empty(max(numel, 1 << 16), dtype=dtype)
    return t[:numel]


class TileReader:
    """Reads whole KV tiles of one cache view through a group's block-table rows.

    ``bt_rows`` [B, max_blocks] long and ``kv`` [B] long describe the group's sequences.
    When a KV tile is a whole number of cache "units" (pages, or TILE_K slices of larger
    pages) a read is one ``index_select`` of units (memcpy speed for any layout whose
    token rows are contiguous, still correct for any strides); other page sizes fall
    back to per-token advanced indexing.  Positions past a sequence's end read as 0
    (units path) or as the sequence's last token (fallback): their scores are masked to
    -inf, and 0 * garbage could be NaN.

    :meth:`plan` resolves the unit ids of one chunk (the group's first ``b`` sequences,
    tiles ``t0 .. t0+c-1``) once, :meth:`plan_tiles` those of given (sequence, tile)
    pairs; :meth:`read` (a slice of sequences, all tiles) and
    :meth:`read_tiles` (given (sequence, tile) pairs, one KV head) then only gather.
    Results live in a buffer reused by the next call: ``index_select`` into a
    preallocated ``out`` is several times faster on CPU than letting it allocate, and a
    small reused buffer stays in cache for the matmul that consumes it.
    """

    def __init__(self, cache, bt_rows, kv, page_size, name):
        self.cache, self.bt_rows, self.kv, self.page, self.name = cache, bt_rows, kv, page_size, name
        self.units, self.unit, self.per_block = None, 0, 0
        if TILE_K % page_size == 0:
            self.unit, self.units, self.per_block = page_size, cache, 1
        elif page_size % TILE_K == 0:
            split = cache.unflatten(1, (page_size // TILE_K, TILE_K))
            if split.stride(0) == split.shape[1] * split.stride(1):
                self.unit, self.per_block = TILE_K, page_size // TILE_K
                self.units = split.flatten(0, 1)
        # One KV head's tiles are gathered as rows of D elements when the units view is
        # [N, unit, Hkv, D] contiguous (index_select of a strided per-head view is slow).
        self.rows = None
        if self.units is not None:
            u = self.units
            if u.stride(3) == 1 and u.stride(2) == u.shape[3] and u.stride(1) == u.shape[2] * u.shape[3] \
                    and u.stride(0) == u.shape[1] * u.stride(1):
                self.rows = u.reshape(-1, u.shape[3])
        # Readers of the same kind resolve the same plan (K and V share the block table).
        self.kind = (self.units is None, self.unit, self.per_block)

    def plan(self, b: int, t0: int, c: int, base: torch.Tensor | None = None):
        """Unit ids ``[b, c, units per tile]`` (or token (block, offset) ids ``[b, c, TILE_K]``)
        and the ``[b, c, TILE_K]`` mask of positions past each sequence's end (None if none)
        of the tiles ``base + t0 .. base + t0 + c - 1`` of the group's first ``b`` sequences
        (``base`` [B] long: each sequence's first walked tile, 0 if ``None``)."""
        pos = torch.arange(t0 * TILE_K, (t0 + c) * TILE_K)[None, :]
        if base is not None:
            pos = pos + base[:b, None] * TILE_K
        return self._resolve(None, b, c, pos)

    def plan_tiles(self, seq: torch.Tensor, tile: torch.Tensor):
        """The plan of one tile per pair: tile ``tile[i]`` (absolute) of the group's sequence
        ``seq[i]``, laid out as :meth:`plan`'s with ``b = n`` and ``c = 1`` (so every pair is
        ``read_tiles(plan, torch.arange(n), 0, head)``)."""
        pos = tile[:, None] * TILE_K + torch.arange(TILE_K)
        return self._resolve(seq, seq.shape[0], 1, pos)

    def _resolve(self, seq, b: int, c: int, pos: torch.Tensor):
        """:meth:`plan`'s ids and mask of positions ``pos`` ``[b or 1, c * TILE_K]`` (increasing
        along each row) of the group's sequences ``seq`` [b] (``None``: the first ``b``)."""
        kv = (self.kv[:b] if seq is None else self.kv[seq])[:, None]

        def blocks(idx):            # block-table entries [b, n] of block indices idx [b or 1, n]
            if seq is None:
                return self.bt_rows[:b].gather(1, idx.expand(b, -1))
            return self.bt_rows[seq[:, None], idx]

        invalid = pos >= kv
        invalid = invalid.view(b, c, TILE_K) if bool(invalid[:, -1].any()) else None
        if self.units is None:
            pos = torch.minimum(pos, kv - 1)
            blk = blocks(pos // self.page)
            return (blk.view(b, c, TILE_K), (pos % self.page).expand(b, -1).reshape(b, c, TILE_K)), None
        start = torch.minimum(pos[:, ::self.unit], (kv - 1) // self.unit * self.unit)
        start = start.expand(b, -1)
        blk = blocks(start // self.page)
        ids = blk * self.per_block + (start % self.page) // self.unit
        return ids.view(b, c, -1), invalid

    def _gather(self, ids, invalid, head):
        if self.units is None:
            blk, off = ids
            x = self.cache[blk, off] if head is None else self.cache[blk, off, head]
            return (x.flatten(1, 2) if blk.dim() == 3 else x).float()
        n = ids.shape[0]
        if head is not None:
            hkv, unit = self.units.shape[2], self.unit
            if self.rows is not None:
                rows = ((ids[:, :, None] * unit + torch.arange(unit)) * hkv + head).view(-1)
                x = buffer(self.name, rows.numel() * self.rows.shape[1], self.cache.dtype).view(-1, self.rows.shape[1])
                torch.index_select(self.rows, 0, rows, out=x)
                x = x.view(n, -1, self.rows.shape[1]).float()
                if invalid is not None:
                    inv = invalid.reshape(n, -1)
                    if bool(inv.any()):
                        x[inv] = 0.0
                return x
            return self._gather(ids, invalid, None)[:, :, head]
        units = self.units
        shape = (ids.numel(),) + units.shape[1:]
        x = buffer(self.name, math.prod(shape), self.cache.dtype).view(shape)
        torch.index_select(units, 0, ids.reshape(-1), out=x)
        x = x.view((n, -1) + units.shape[2:]).float()
        if invalid is not None:
            inv = invalid.reshape(n, -1)
            if bool(inv.any()):
                x[inv] = 0.0
        return x

    def read(self, plan, b0: int, b1: int) -> torch.Tensor:
        """The planned tiles of sequences ``b0:b1`` as fp32 ``[b1 - b0, c * TILE_K, Hkv, D]``."""
        ids, invalid = plan
        ids = (ids[0][b0:b1], ids[1][b0:b1]) if self.units is None else ids[b0:b1]
        return self._gather(ids, None if invalid is None else invalid[b0:b1], None)

    def read_tiles(self, plan, seq: torch.Tensor, tile: torch.Tensor, head: int) -> torch.Tensor:
        """Planned tiles ``tile`` [n] (0-based in the chunk) of sequences ``seq`` [n], one
        KV ``head``, as fp32 ``[n, TILE_K, D]``."""
        ids, invalid = plan
        ids = (ids[0][seq, tile], ids[1][seq, tile]) if self.units is None else ids[seq, tile]
        return self._gather(ids, None if invalid is None else invalid[seq, tile], head)


def sub_batches(b: int, per_seq: int):
    """Split ``b`` sequences into runs whose gathered K/V (``per_seq`` elements each) stay
    within ``SUB_BUDGET`` elements, so each run is consumed from cache right after its read."""
    step = max(1, SUB_BUDGET // max(per_seq, 1))
    return [(b0, min(b, b0 + step)) for b0 in range(0, b, step)]
