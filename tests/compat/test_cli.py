"""``python -m compat`` as a user runs it, with and without a (stub) vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from compat import envs
from tests.compat.stub_vllm import write_stub

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, pythonpath: list[str] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    environ = envs.without_ours()
    environ["PYTHONPATH"] = os.pathsep.join([*pythonpath, str(ROOT)])
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "compat", *args], capture_output=True, text=True, env=environ, cwd=ROOT, timeout=120)


def test_cli_reports_packed_era_stub(tmp_path):
    write_stub(tmp_path, version="0.31.0", view_construction=True,
               backends={"FLASHINFER": {"shape": None, "flag": False}, "CPU_ATTN": {"import_error": "no CPU ops"}})
    text = run_cli(pythonpath=[str(tmp_path)])
    assert text.returncode == 0, text.stderr
    assert "vLLM: 0.31.0" in text.stdout
    fi_line = next(line for line in text.stdout.splitlines() if line.startswith("FLASHINFER"))
    assert "packed" in fi_line and "probe" in fi_line and "vllm" in fi_line
    assert "not importable: ImportError: no CPU ops" in text.stdout
    # compat's fp8 writer rounds as each layout's own writer does (CUDA: nearest-even)
    assert "fp8 cache writes FLASHINFER: nearest-even" in text.stdout and "fp8 cache writes CPU_ATTN" not in text.stdout

    as_json = run_cli("--json", pythonpath=[str(tmp_path)])
    data = json.loads(as_json.stdout)
    assert data["vllm_version"] == "0.31.0"
    assert data["backends"]["FLASHINFER"]["layout"] == "packed"
    assert data["backends"]["FLASHINFER"]["writer"] == "vllm"
    assert data["backends"]["CPU_ATTN"]["importable"] is False


def test_cli_without_vllm_and_with_bad_override():
    import importlib.util

    text = run_cli()
    assert text.returncode == 0, text.stderr
    if importlib.util.find_spec("vllm") is None:
        assert text.stdout.startswith("vLLM: not installed")
    else:
        assert text.stdout.startswith("vLLM: ") and "not installed" not in text.stdout.splitlines()[0]
    bad = run_cli(env={"SPARSE_ATTN_CACHE_WRITER": "both"})
    assert bad.returncode == 2
    assert "SPARSE_ATTN_CACHE_WRITER" in bad.stderr and "auto, vllm, adapter" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_help_explains():
    text = run_cli("--help")
    assert text.returncode == 0 and "--json" in text.stdout and "SPARSE_ATTN_KV_LAYOUT" in text.stdout


def test_cli_exits_nonzero_for_any_invalid_variable_it_shows():
    """SPARSE_ATTN_STRICT is not read by the probe; an invalid value must still fail here."""
    bad = run_cli(env={"SPARSE_ATTN_STRICT": "maybe", "SPARSE_ATTN_STATS_INTERVAL_S": "-1"})
    assert bad.returncode == 2, bad.stdout
    assert "SPARSE_ATTN_STRICT='maybe' is not a boolean" in bad.stderr
    assert "SPARSE_ATTN_STATS_INTERVAL_S='-1' is not a number >= 0" in bad.stderr
    assert "SPARSE_ATTN_STRICT=maybe (INVALID)" in bad.stdout and "Traceback" not in bad.stderr


def test_cli_treats_empty_variables_as_defaults():
    text = run_cli(env={name: "" for name in envs.variables()})
    assert text.returncode == 0, text.stderr


def test_cli_refuses_a_duplicate_backend_in_the_layout_override():
    bad = run_cli(env={"SPARSE_ATTN_KV_LAYOUT": "CPU_ATTN=cpu-packed,CPU_ATTN=packed"})
    assert bad.returncode == 2 and "CPU_ATTN is given twice" in bad.stderr
