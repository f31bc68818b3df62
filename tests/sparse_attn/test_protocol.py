"""sparse_attn.protocol: stdlib only, one definition of the driver <-> worker contract,
and the worker-side counters (sparse_attn.stats) that answer it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from sparse_attn import protocol
from sparse_attn.stats import WorkerStats


def test_protocol_imports_neither_vllm_torch_nor_compat():
    code = ("import sys, sparse_attn.protocol as p; "
            "print(sorted(m for m in ('vllm', 'torch', 'compat', 'compat.probe') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_importing_compat_probes_nothing():
    code = "import compat, sys; print(compat._report is None, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_phases_have_one_definition():
    from sparse_attn import config, stats
    from sparse_attn.calibration import runner
    from sparse_attn.demo import run

    assert config.PHASES is runner.PHASES is run.PHASES is stats.PHASES is protocol.PHASES
    assert runner.merge_worker_counts is protocol.merge_worker_counts


@pytest.mark.parametrize("scales", [pytest.param([], id="empty"), pytest.param([0.5, 0.0], id="zero"),
                                    pytest.param([float("nan")], id="nan"), pytest.param([-1.0], id="negative")])
def test_calibration_env_refuses_bad_scales(scales):
    with pytest.raises(ValueError, match="non-empty list of finite numbers > 0"):
        protocol.calibration_env(scales)


def test_calibration_env_round_trips_through_the_registry(monkeypatch):
    from compat import envs

    env = protocol.calibration_env([0.01, 2, 40.5])
    assert list(env) == [protocol.CALIBRATION_ENV] and protocol.CALIBRATION_ENV in envs.variables()
    assert envs.variables()[protocol.CALIBRATION_ENV].internal
    monkeypatch.setenv(protocol.CALIBRATION_ENV, env[protocol.CALIBRATION_ENV])
    envs.reset_for_tests()
    try:
        assert envs.get(protocol.CALIBRATION_ENV) == (0.01, 2.0, 40.5)
    finally:
        envs.reset_for_tests()


@pytest.mark.parametrize("raw", ["[0.1, \"x\"]", "not json", "{}", "[]", "[0]", "[true]"])
def test_malformed_calibration_variable_is_an_override_error(monkeypatch, raw):
    import compat
    from compat import envs

    monkeypatch.setenv(protocol.CALIBRATION_ENV, raw)
    envs.reset_for_tests()
    try:
        with pytest.raises(compat.InvalidOverrideError) as info:
            envs.get(protocol.CALIBRATION_ENV)
    finally:
        envs.reset_for_tests()
    assert info.value.observed == repr(raw) and "sparse-attn calibrate" in info.value.fix


def snapshot(phases):
    return {"phases": {p: dict(zip(protocol.PHASE_COUNTERS, counts)) for p, counts in phases.items()}}


def test_phase_totals_sum_over_workers():
    workers = [snapshot({"decode": (3, 10, 1, 0, 2, 4, 1)}), snapshot({"decode": (4, 20, 2, 5, 0, 8, 2)})]
    assert protocol.phase_totals(workers, "decode") == {"skipped": 7, "visited": 30, "launches": 3,
                                                        "native_launches": 5, "dense_launches": 2,
                                                        "v_tested": 12, "v_skipped": 3}


def test_snapshot_has_the_protocol_keys_and_device_counts_add_in():
    stats = WorkerStats()
    stats.add("prefill", 3, 10)
    with torch.inference_mode():  # as vLLM runs forwards: the accumulator is an inference tensor
        stats.device_counter("decode", torch.device("cpu")).add_(torch.tensor([2, 8, 1, 0, 0, 3, 1]))
        stats.device_counter("decode", torch.device("cpu")).add_(torch.tensor([1, 8, 1, 0, 0, 3, 0]))
    stats.set_install({"installed": 2, "total": 2, "backends": ["CPU_ATTN"]}, ("LlamaAttention",))
    snap = stats.snapshot(reset=True)
    assert set(snap) | {"rank"} == set(protocol.SNAPSHOT_KEYS)
    assert snap["phases"]["decode"] == {"skipped": 3, "visited": 16, "launches": 2, "native_launches": 0, "dense_launches": 0,
                                        "v_tested": 6, "v_skipped": 1}
    assert snap["phases"]["prefill"]["skipped"] == 3 and snap["install"]["backends"] == ["CPU_ATTN"]
    assert json.loads(json.dumps(snap)) == snap, "the RPC answer must serialise"
    after = stats.snapshot()
    assert after["phases"]["decode"]["visited"] == 0 and after["layers_installed"] == 2, "reset zeroes counters only"


def test_sparsity_line_is_logged_once_per_worker_per_interval(caplog):
    stats = WorkerStats(last_log=0.0)
    with caplog.at_level(logging.INFO, logger="sparse_attn"):
        logged = [stats.maybe_log(60.0, now=t) for t in (61.0, 61.0, 62.0, 100.0, 121.5)]  # e.g. 3 layers asking at 61
    assert logged == [True, False, False, False, True]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(l.startswith("sparse-attn: achieved sparsity: prefill n/a") for l in lines)
    assert stats.maybe_log(0, now=1e9) is False, "interval 0 turns the line off"


def test_the_log_line_says_how_many_v_tiles_went_unread_where_a_kernel_counted_them():
    from sparse_attn.stats import format_phases

    counted = dict(zip(protocol.PHASE_COUNTERS, (40, 100, 3, 0, 0, 50, 15)))
    uncounted = dict(zip(protocol.PHASE_COUNTERS, (40, 100, 3, 0, 0, 0, 0)))  # Triton / torch: no V-tile counts
    line = format_phases({"decode": counted, "prefill": uncounted})
    assert line.startswith("decode 40.0% of 100 tiles, V unread 30.0% (3 sparse")
    assert "prefill 40.0% of 100 tiles (3 sparse" in line
