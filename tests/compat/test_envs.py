"""The env registry: parsing, refusal of bad values, README in step with it, and the split between
compat's own variables and the product's (``sparse_attn.settings``), joined through the entry point."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import compat
from compat import envs

README = Path(__file__).resolve().parents[2] / "README.md"
#: the environment-variable table: the compat page, which README links to
ENV_TABLE_DOC = README.parent / "docs" / "compat.md"


@pytest.fixture(autouse=True)
def fresh_env():
    envs.reset_for_tests()
    yield
    envs.reset_for_tests()


@pytest.mark.parametrize("raw, expected", [
    pytest.param("", {}, id="empty"),
    pytest.param("packed", {b: "packed" for b in envs.BACKENDS}, id="one-for-all"),
    pytest.param("FLASHINFER=blocks-first", {"FLASHINFER": "blocks-first"}, id="one-backend"),
    pytest.param(" FLASHINFER = packed , CPU_ATTN=cpu-packed ,", {"FLASHINFER": "packed", "CPU_ATTN": "cpu-packed"}, id="pairs-with-spaces"),
])
def test_layout_override_parses(monkeypatch, raw, expected):
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", raw)
    assert envs.get("SPARSE_ATTN_KV_LAYOUT") == expected


@pytest.mark.parametrize("name, raw, listed", [
    pytest.param("SPARSE_ATTN_KV_LAYOUT", "nhd", "blocks-first, kv-first, packed, cpu-packed", id="layout-unknown"),
    pytest.param("SPARSE_ATTN_KV_LAYOUT", "TRITON_ATTN=packed", "FLASHINFER, FLASH_ATTN, CPU_ATTN", id="layout-backend-unknown"),
    pytest.param("SPARSE_ATTN_KV_LAYOUT", "FLASHINFER=packed,CPU_ATTN", "BACKEND=layout", id="layout-item-malformed"),
    pytest.param("SPARSE_ATTN_CACHE_WRITER", "engine", "auto, vllm, adapter", id="writer-unknown"),
    pytest.param("SPARSE_ATTN_DISABLE", "maybe", "'1'", id="flag-unknown"),
    pytest.param("SPARSE_ATTN_STATS_INTERVAL_S", "-5", ">= 0", id="interval-negative"),
    pytest.param("SPARSE_ATTN_STATS_INTERVAL_S", "nan", ">= 0", id="interval-nan"),
    pytest.param("SPARSE_ATTN_CPU_KERNEL", "avx2", "auto, compiled, torch", id="cpu-kernel-unknown"),
])
def test_bad_values_raise_with_choices(monkeypatch, name, raw, listed):
    monkeypatch.setenv(name, raw)
    with pytest.raises(compat.InvalidOverrideError) as info:
        envs.get(name)
    assert listed in str(info.value) and name in str(info.value)
    assert isinstance(info.value, ValueError)


def test_values_are_parsed_once_until_reset(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "vllm")
    assert envs.get("SPARSE_ATTN_CACHE_WRITER") == "vllm"
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "adapter")
    assert envs.get("SPARSE_ATTN_CACHE_WRITER") == "vllm"
    envs.reset_for_tests()
    assert envs.get("SPARSE_ATTN_CACHE_WRITER") == "adapter"


def test_applied_override_is_logged_once(monkeypatch, caplog):
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "adapter")
    with caplog.at_level("INFO", logger="compat"):
        envs.get("SPARSE_ATTN_CACHE_WRITER")
        envs.get("SPARSE_ATTN_CACHE_WRITER")
    assert [r.getMessage() for r in caplog.records].count("sparse-attn: override SPARSE_ATTN_CACHE_WRITER=adapter applied") == 1


def test_defaults(monkeypatch):
    for name in envs.variables():
        monkeypatch.delenv(name, raising=False)
    assert envs.get("SPARSE_ATTN_KV_LAYOUT") == {}
    assert envs.get("SPARSE_ATTN_CACHE_WRITER") == "auto"
    assert envs.get("SPARSE_ATTN_DISABLE") is False and envs.get("SPARSE_ATTN_STRICT") is False
    assert envs.get("SPARSE_ATTN_STATS_INTERVAL_S") == 60.0
    assert envs.get("SPARSE_ATTN_CPU_KERNEL") == "auto" and envs.get("SPARSE_ATTN_CPU_KERNEL_CACHE") == ""


def test_readme_documents_every_variable_and_no_other():
    """The table README links to (docs/compat.md) lists every variable with its default, and no other."""
    rows = re.findall(r"^\|\s*`(SPARSE_ATTN_[A-Z0-9_]+)`\s*\|\s*`([^`]*)`\s*\|", ENV_TABLE_DOC.read_text(), flags=re.M)
    assert {name: default for name, default in rows} == {name: var.default for name, var in envs.variables().items()}


@pytest.mark.parametrize("name", list(envs.variables()))
@pytest.mark.parametrize("raw", ["", "   "], ids=["empty", "blank"])
def test_empty_means_default_for_every_variable(monkeypatch, name, raw):
    monkeypatch.delenv(name, raising=False)
    default = envs.get(name)
    envs.reset_for_tests()
    monkeypatch.setenv(name, raw)
    assert envs.get(name) == default


def test_duplicate_backend_in_layout_override_is_an_error(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "FLASHINFER=packed,CPU_ATTN=cpu-packed,FLASHINFER=kv-first")
    with pytest.raises(compat.InvalidOverrideError) as info:
        envs.get("SPARSE_ATTN_KV_LAYOUT")
    assert "FLASHINFER is given twice ('packed' and 'kv-first')" in str(info.value)


def test_every_layout_name_the_env_accepts_has_a_view_in_the_catalogue():
    from compat import layouts

    assert set(envs.LAYOUT_NAMES) == {layout.value for layout in layouts.VIEW_FUNCTIONS}


@pytest.mark.parametrize("name", ["SPARSE_ATTN_KV_LAYOUT", "SPARSE_ATTN_CACHE_WRITER", "SPARSE_ATTN_DISABLE", "SPARSE_ATTN_STRICT",
                                  "SPARSE_ATTN_CPU_KERNEL"])
def test_every_documented_choice_is_accepted(monkeypatch, name):
    """The choices text shown by `python -m compat` and the README lists only values the parser takes."""
    listed = [c.strip().removeprefix("backends ") for part in envs.variables()[name].choices.split(";") for c in part.split(",")]
    backends = [c for c in listed if c in envs.BACKENDS]
    values = [c for c in listed if c not in envs.BACKENDS]
    assert values
    for value in values:
        envs.reset_for_tests()
        monkeypatch.setenv(name, value)
        envs.get(name)
    for backend in backends:
        envs.reset_for_tests()
        monkeypatch.setenv(name, f"{backend}={values[0]}")
        assert envs.get(name) == {backend: values[0]}


def test_compat_declares_only_the_variables_that_steer_its_answers_about_vllm():
    """The product's knobs are sparse_attn.settings'; the registry holds both, once each."""
    from sparse_attn import settings

    own = [var.name for var in envs.COMPAT_VARIABLES]
    assert own == ["SPARSE_ATTN_KV_LAYOUT", "SPARSE_ATTN_CACHE_WRITER", "SPARSE_ATTN_CUDAGRAPH",
                   "SPARSE_ATTN_CPU_PAGE_ISA", "SPARSE_ATTN_CPU_OPS_MODULE"]
    product = [var.name for var in settings.VARIABLES]
    assert not set(own) & set(product)
    assert list(envs.variables()) == own + product
    assert all(envs.variables()[var.name] is var for var in settings.VARIABLES)


def test_python_m_compat_sees_the_product_variables_without_importing_sparse_attn():
    """compat never imports sparse_attn; the ``compat.envs`` entry point brings its variables in, so
    ``python -m compat`` lists, validates and spell-checks them in a process that never imported it."""
    from sparse_attn import settings

    probe = ("import sys, compat.envs as e; before = 'sparse_attn.settings' in sys.modules; names = list(e.variables()); "
             "print(before, ','.join(names))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env=envs.without_ours(), cwd=README.parent)
    assert out.returncode == 0, out.stderr
    before, names = out.stdout.split()
    assert before == "False" and names.split(",") == list(envs.variables())
    helptext = subprocess.run([sys.executable, "-m", "compat", "--help"], capture_output=True, text=True, timeout=120,
                              env=envs.without_ours(), cwd=README.parent).stdout
    assert all(var.name in helptext for var in settings.VARIABLES)
    typo = subprocess.run([sys.executable, "-m", "compat"], capture_output=True, text=True, timeout=120, cwd=README.parent,
                          env={**envs.without_ours(), "SPARSE_ATTN_STRICT": "1", "SPARSE_ATTN_STRIKT": "1"}).stderr
    assert "SPARSE_ATTN_STRIKT is not a variable sparse-attn reads" in typo and "did you mean SPARSE_ATTN_STRICT" in typo
    assert "SPARSE_ATTN_STRICT is not" not in typo


def test_settings_get_reads_only_the_product_variables(monkeypatch):
    from sparse_attn import settings

    monkeypatch.setenv("SPARSE_ATTN_STRICT", "yes")
    assert settings.get("SPARSE_ATTN_STRICT") is True
    with pytest.raises(KeyError, match="SPARSE_ATTN_KV_LAYOUT is not one of sparse_attn.settings' variables"):
        settings.get("SPARSE_ATTN_KV_LAYOUT")


@pytest.mark.parametrize("var, message", [
    pytest.param(envs.EnvVar("SPARSE_ATTN_KV_LAYOUT", "", "another", envs.parse_path, "x"), "already registered", id="taken-name"),
    pytest.param(envs.EnvVar("OTHER_NAME", "", "doc", envs.parse_path, "x"), "starts with SPARSE_ATTN_", id="foreign-prefix"),
])
def test_register_refuses_a_second_declaration_or_a_foreign_name(var, message):
    with pytest.raises(ValueError, match=message):
        envs.register(var)
    envs.register(envs.COMPAT_VARIABLES[0])  # the same declaration again is a no-op


def test_without_ours_drops_exactly_the_project_variables():
    environ = {"SPARSE_ATTN_DISABLE": "1", "SPARSE_ATTN_TYPO": "x", "PATH": "/bin", "sparse_attn_lower": "1", "VLLM_X": "y"}
    assert envs.without_ours(environ) == {"PATH": "/bin", "sparse_attn_lower": "1", "VLLM_X": "y"}
    assert environ["SPARSE_ATTN_DISABLE"] == "1"  # a copy
