"""compat's errors carry their four answers as fields and build the message from them."""

from __future__ import annotations

import sys
import types

import pytest

import compat
from compat.errors import CompatError, KVWriteError


def test_message_is_built_from_the_fields():
    err = KVWriteError("new key tokens do not fit", observed="shape [3, 2]", expected="[2, 2]", fix="pass the layer's rows",
                       vllm_version="0.32.0")
    assert str(err) == "new key tokens do not fit; observed shape [3, 2]; expected [2, 2]; vLLM 0.32.0. Fix: pass the layer's rows"
    assert isinstance(err, ValueError) and isinstance(err, compat.CompatError)


def test_version_comes_from_an_imported_vllm_only(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert "vLLM not imported in this process" in str(CompatError("x", observed=1, fix="f"))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.29.1"))
    err = CompatError("x", observed=1, fix="f")
    assert err.vllm_version == "0.29.1" and "vLLM 0.29.1" in str(err)
    assert "no vLLM installed" in str(CompatError("x", observed=1, vllm_version=None)), "the probe knows it is absent"


def test_a_bare_message_is_still_accepted():
    assert str(CompatError("plain text")) == "plain text"


def test_layout_errors_are_structured():
    import torch

    from compat import layouts

    with pytest.raises(compat.UnsupportedLayoutError) as info:
        layouts.views("packed", torch.zeros(2, 3, 4), 8)
    assert info.value.expected.startswith("logical shape [num_blocks, num_kv_heads, block_size, 2 * head_size]")
    assert "SPARSE_ATTN_KV_LAYOUT=BACKEND=<layout>" in info.value.fix and info.value.observed.startswith("strides")
