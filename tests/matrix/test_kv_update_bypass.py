"""The real backends' ``supports_kv_cache_update_bypass`` (vLLM 0.33+) against what compat decides.

A backend that declares it lets a model's fused op store the new K/V and call ``forward`` with
``key``/``value`` ``None`` (vLLM's own precondition: ``forward_includes_kv_cache_update`` False, so
vLLM's ``do_kv_cache_update`` owned the write and the tokens are in the cache before ``forward``).
compat records the flag per backend, the sparse impl built from the real impl class treats such a
call as tokens already stored (no write, the sparse path reads the cache; the arithmetic is in
tests/sparse_attn/test_adapter.py), and a call with only one of them goes native.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import compat
from compat import worker
from tests.matrix.test_forward_contract import BACKEND_CLASSES

pytestmark = pytest.mark.vllm


def backend_class(name: str) -> type:
    module, cls = BACKEND_CLASSES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        pytest.skip(f"{name} not importable here: {type(exc).__name__}: {exc}")


@pytest.fixture(autouse=True)
def fresh():
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


@pytest.mark.parametrize("name", list(BACKEND_CLASSES))
def test_compat_records_the_backends_own_declaration(name):
    cls = backend_class(name)
    declared = getattr(cls, "supports_kv_cache_update_bypass", False)
    report = compat.probe().backend(name)
    assert report.kv_update_bypass is (declared is True)
    if declared:
        # vLLM fuses the insert only where forward does not store the cache itself
        assert cls.forward_includes_kv_cache_update is False and report.writer == "vllm", report.writer_detail


@pytest.mark.parametrize("name", list(BACKEND_CLASSES))
def test_a_bypass_call_to_the_real_impl_signature_is_tokens_stored(name):
    backend_class(name)
    params = worker.FORWARD_PARAMETERS
    values = {p: object() for p in params}
    values.update(key=None, value=None, output_scale=None, output_block_scale=None)
    call = worker.describe_call(*[values[p] for p in params])
    assert call.native_only is None and call.tokens_stored
    values.update(value=object())
    half = worker.describe_call(*[values[p] for p in params])
    assert half.native_only == "only one of key / value given" and not half.tokens_stored

