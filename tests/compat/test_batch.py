"""compat.batch: one description per step, vLLM's host copies of the batch lengths (exact or an
upper bound), and the per-phase rows every layer of the step shares."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from compat import batch as cbatch
from compat import model


@dataclasses.dataclass
class Direct:
    """FLASH_ATTN / CPU_ATTN-like metadata: the fields on the metadata itself."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int


def lengths(q_lens):
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return starts


def direct(q_lens, kv_lens, device="cpu"):
    starts = lengths(q_lens)
    table = torch.arange(len(kv_lens) * 3, dtype=torch.int32).view(len(kv_lens), 3)
    return Direct(torch.tensor(starts, dtype=torch.int32).to(device), torch.tensor(kv_lens, dtype=torch.int32).to(device),
                  table.to(device), torch.arange(starts[-1]).to(device), starts[-1], max(q_lens), max(kv_lens))


def captured(q_lens, kv_lens, device, **host):
    """Metadata whose builder input (CommonAttentionMetadata) was captured, with the host copies in ``host``."""
    d = direct(q_lens, kv_lens, device)
    common = types.SimpleNamespace(query_start_loc=d.query_start_loc, seq_lens=d.seq_lens, block_table_tensor=d.block_table,
                                   slot_mapping=d.slot_mapping, num_actual_tokens=d.num_actual_tokens,
                                   max_query_len=d.max_query_len, max_seq_len=d.max_seq_len, causal=True, **host)
    metadata = types.SimpleNamespace()
    setattr(metadata, cbatch._CAPTURED_ATTR, (0, common))
    return metadata


Q, KV = [1, 37, 1, 5], [40, 37, 9, 20]
HOST = dict(query_start_loc_cpu=torch.tensor(lengths(Q), dtype=torch.int32))


@pytest.fixture
def reads(monkeypatch):
    seen = []
    real = cbatch._read_device

    def counting(tensor):
        seen.append(tuple(tensor.shape))
        return real(tensor.to("cpu") if tensor.device.type != "meta" else torch.zeros(tensor.shape, dtype=tensor.dtype))

    monkeypatch.setattr(cbatch, "_read_device", counting)
    return seen


def test_a_cpu_batch_is_its_own_exact_host_copy(reads):
    md = direct(Q, KV)
    batch = model.describe_batch(md)
    assert batch.query_start_loc_host is md.query_start_loc and batch.seq_lens_host is md.seq_lens and batch.seq_lens_host_exact
    assert batch.host_lengths() == (tuple(lengths(Q)), tuple(KV), True) and reads == []


def test_exact_host_copies_mean_no_device_read(reads):
    """Device tensors on ``meta``: any read of them would raise; vLLM's host copies suffice."""
    md = captured(Q, KV, "meta", seq_lens_cpu=torch.tensor(KV), **HOST)
    batch = model.describe_batch(md)
    assert batch.seq_lens_host_exact and batch.host_lengths() == (tuple(lengths(Q)), tuple(KV), True) and reads == []
    rows = batch.phase_rows()
    assert set(rows) == {"decode", "prefill"} and reads == []


def test_an_upper_bound_costs_one_read_of_the_kv_lengths_per_step(reads):
    """vLLM 0.32 keeps only ``seq_lens_cpu_upper_bound`` (optimistic on async spec-decode rows):
    the exact lengths are read once for the step, whatever number of layers ask."""
    bound = torch.tensor([v + 3 for v in KV])
    md = captured(Q, KV, "cpu", seq_lens_cpu_upper_bound=bound, **HOST)
    md_dev = captured(Q, KV, "meta", seq_lens_cpu_upper_bound=bound, **HOST)
    batch = model.describe_batch(md_dev)
    assert batch.seq_lens_host is bound and not batch.seq_lens_host_exact
    for _ in range(4):  # four layers of one step
        model.describe_batch(md_dev).host_lengths()
        model.describe_batch(md_dev).phase_rows()
    assert reads == [(4,)], "one read of seq_lens for the step, none of query_start_loc"
    assert model.describe_batch(md).host_lengths()[1:] == (tuple(KV), True), "on CPU the tensors are exact host copies"
    assert model.describe_batch(md_dev).host_lengths(exact=False)[1:] == (tuple(bound.tolist()), False)
    assert model.describe_batch(md_dev).phase_rows(exact=False)["prefill"].kv_lens_exact is False
    assert reads == [(4,)]


def test_accepting_the_bound_reads_nothing(reads):
    bound = torch.tensor([v + 3 for v in KV])
    md = captured(Q, KV, "meta", seq_lens_cpu_upper_bound=bound, **HOST)
    rows = model.describe_batch(md).phase_rows(exact=False)
    assert reads == [] and rows["decode"].kv_lens == (43, 12) and not rows["decode"].kv_lens_exact


def test_without_host_copies_one_read_serves_the_step(reads):
    md = captured(Q, KV, "meta")
    for _ in range(3):
        model.describe_batch(md).host_lengths()
    assert reads == [(len(Q) + 1 + len(KV),)], "query offsets and KV lengths in one copy"


def test_one_description_per_metadata_object():
    md = direct(Q, KV)
    assert model.describe_batch(md) is model.describe_batch(md)
    assert model.describe_batch(direct(Q, KV)) is not model.describe_batch(md), "a new step, a new description"


def test_phase_rows_are_the_sequences_of_each_phase():
    md = direct(Q, KV)
    rows = model.describe_batch(md).phase_rows()
    starts = lengths(Q)
    for phase, seqs in (("decode", [0, 2]), ("prefill", [1, 3])):
        r = rows[phase]
        assert r.seqs == tuple(seqs)
        expected_rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs])
        assert torch.equal(torch.arange(starts[-1])[r.rows], expected_rows)
        assert torch.equal(r.block_table, md.block_table[seqs]) and torch.equal(r.seq_lens, md.seq_lens[seqs])
        q_lens = [Q[s] for s in seqs]
        assert r.query_start_loc.tolist() == lengths(q_lens) and r.q_lens == tuple(q_lens)
        assert r.kv_lens == tuple(KV[s] for s in seqs) and r.q_starts == tuple(lengths(q_lens)[:-1])


def test_adjacent_sequences_are_slices_of_the_batch():
    md = direct([5, 7, 1, 1], [5, 9, 30, 31])
    rows = model.describe_batch(md).phase_rows()
    assert rows["prefill"].rows == slice(0, 12) and rows["decode"].rows == slice(12, 14)
    assert rows["decode"].block_table.data_ptr() == md.block_table[2:].data_ptr(), "a view, no copy"
    assert rows["decode"].query_start_loc.tolist() == [0, 1, 2]


def test_sequences_without_query_rows_are_in_no_phase():
    rows = model.describe_batch(direct([1, 0, 1], [10, 0, 12])).phase_rows()
    assert rows["decode"].seqs == (0, 2) and "prefill" not in rows
