"""Backends the release registers beyond the three compat serves (0.34's ``FLASHINFER_TS``, ...) and
0.34's ``AttentionType`` StrEnum, against the real release (every matrix env).

A layer on a backend compat does not serve stays native, with a reason that names the backend,
counted in the install summary; compat's probe says the backend is unknown rather than guessing a
layout. The attention type is read as its plain value whatever the class (a str constant up to
0.33, a ``StrEnum`` member from 0.34).
"""

from __future__ import annotations

import importlib
import importlib.util
import types

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import compat
from compat import envs
from compat import model as cmodel
from sparse_attn import plugin
from sparse_attn.adapter import Policy

pytestmark = pytest.mark.vllm


def registry():
    try:
        return importlib.import_module("vllm.v1.attention.backends.registry").AttentionBackendEnum
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no backend registry in this release: {exc}")


def unserved_names() -> list[str]:
    """Names the release's own registry lists that compat does not serve (import-free: enum members)."""
    return sorted(set(registry().__members__) - set(envs.BACKENDS))


def test_an_unserved_backend_is_unknown_to_compat():
    report = compat.probe()
    for name in unserved_names():
        with pytest.raises(compat.UnknownBackendError, match=f"backend '{name}' is not served"):
            report.backend(name)


def test_layers_on_an_unserved_backend_stay_native_and_are_counted(monkeypatch):
    names = unserved_names()
    if not names:
        pytest.skip("this release registers no backend beyond the served ones")
    layers = [(types.SimpleNamespace(impl=None), cmodel.LayerInfo(
        name=f"model.layers.{i}.self_attn.attn", owner_class="LlamaAttention", backend=name, num_heads=8, num_kv_heads=2,
        head_size=64, scale=0.125, cpu_isa=None, features=cmodel.LayerFeatures())) for i, name in enumerate(names)]
    monkeypatch.setattr(cmodel, "attention_layers", lambda model: iter(layers))
    compat.reset_for_tests()
    summary = plugin.install(object(), None, Policy(scale_factors={"prefill": 1.0, "decode": 1.0}, stats_interval_s=0))
    served = ", ".join(compat.probe().backends)
    assert summary["installed"] == 0
    assert summary["native"] == {f"backend {n} is not served (served: {served})": 1 for n in names}


def test_flashinfer_ts_is_one_of_them_from_0_34():
    from compat.probe import installed_vllm_version
    from packaging.version import Version

    if Version(Version(installed_vllm_version()[0]).base_version) < Version("0.34"):
        pytest.skip("FLASHINFER_TS is new in 0.34")
    assert "FLASHINFER_TS" in unserved_names()


def test_attention_types_are_read_as_their_plain_value():
    AttentionType = None
    for module in ("vllm.v1.attention.backend", "vllm.attention.backends.abstract"):  # newer, older home
        try:
            AttentionType = importlib.import_module(module).AttentionType
            break
        except (ImportError, AttributeError):
            continue
    if AttentionType is None:
        pytest.skip("AttentionType is in neither known module")
    members = [getattr(AttentionType, n) for n in ("DECODER", "ENCODER", "ENCODER_ONLY", "ENCODER_DECODER")]
    assert [cmodel._attn_type(m) for m in members] == ["decoder", "encoder", "encoder_only", "encoder_decoder"]
