"""compat.cpu_ops() is the module the release's own CPU backend calls its ops from (every matrix env).

The reference is vLLM itself: ``vllm.v1.attention.backends.cpu_attn`` imports its op wrappers as
``ops`` (``from vllm import _custom_ops as ops`` up to 0.33, ``from vllm import _cpu_ops as ops``
from 0.34). Where that backend calls no ``cpu_attention_with_kv_cache`` (the torch-SDPA CPU backend
of the early lines), compat must find no module either.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import compat
from compat.probe import CPU_OPS

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("SPARSE_ATTN_CPU_OPS_MODULE", raising=False)
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


def backend_ops():
    """The module vLLM's CPU backend imported as ``ops``, or None when it uses none with the CPU ops."""
    try:
        cpu_attn = importlib.import_module("vllm.v1.attention.backends.cpu_attn")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the CPU attention backend is not importable here: {exc}")
    ops = getattr(cpu_attn, "ops", None)
    return ops if ops is not None and all(callable(getattr(ops, op, None)) for op in CPU_OPS) else None


def test_compat_names_the_module_the_cpu_backend_calls():
    theirs = backend_ops()
    decision = compat.cpu_ops_decision()
    assert decision.source == "probe"
    if theirs is None:
        assert decision.module is None, decision.detail
        return
    assert decision.module == theirs.__name__, decision.detail
    assert compat.cpu_ops() is theirs
    for op in CPU_OPS:
        assert getattr(compat.cpu_ops(), op) is getattr(theirs, op)


def test_an_override_naming_the_module_is_recorded_and_a_wrong_one_refused(monkeypatch):
    theirs = backend_ops()
    if theirs is None:
        pytest.skip("this release's CPU backend calls no cpu_attention_with_kv_cache")
    monkeypatch.setenv("SPARSE_ATTN_CPU_OPS_MODULE", theirs.__name__)
    compat.reset_for_tests()
    assert compat.cpu_ops_decision().source == "env" and compat.cpu_ops() is theirs
    # the candidate that is not the answer holds no complete set in this release
    other = next(m for m in ("vllm._cpu_ops", "vllm._custom_ops") if m != theirs.__name__)
    monkeypatch.setenv("SPARSE_ATTN_CPU_OPS_MODULE", other)
    compat.reset_for_tests()
    with pytest.raises(compat.InvalidOverrideError):
        compat.cpu_ops_decision()
