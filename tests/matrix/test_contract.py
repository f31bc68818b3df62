"""Contract tests against a real vLLM release (the tox envs vllm0221 ... vllm0330).

Skipped when vLLM is not importable (the unit env). In a matrix env:

* ``test_release_facts`` re-probes the installed release with tools/probe_release.py and compares
  with tests/matrix/expected/vllm-<version>.json, the facts recorded from that same release
  (regenerate with ``python tests/matrix/tools/probe_release.py --facts --out ...``).
* ``test_compat_views_match_vllm_writer`` runs the release's own ``do_kv_cache_update`` with the
  native op replaced by a recorder and checks that ``compat.kv_cache_views`` returns exactly the
  K/V cache tensors vLLM passes to its kernel (shape, strides, data pointer).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (tests/matrix runs in the tox vllm* envs)", allow_module_level=True)

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "tools"))
import probe_release  # noqa: E402

pytestmark = pytest.mark.vllm

FLASH = ("FLASHINFER", "FLASH_ATTN")


@pytest.fixture(scope="module")
def report():
    os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    return probe_release.probe()


@pytest.fixture(scope="module")
def expected(report):
    ver = report["versions"]["vllm"]
    path = HERE / "expected" / f"vllm-{ver}.json"
    if not path.exists():
        pytest.fail(f"no recorded facts for vLLM {ver}: run tools/probe_release.py --facts --out {path}")
    return json.loads(path.read_text())


def test_backend_modules_import(report):
    assert all(report["imports"].values()), report["imports"]


def test_release_facts(report, expected):
    got = probe_release.facts(report)
    assert got["imports"] == expected["imports"]
    assert got["kv_cache_views"] == expected["kv_cache_views"]
    for name, exp in expected["backends"].items():
        for key in exp:
            assert got["backends"][name].get(key) == exp[key], f"{name}.{key}"



def _cases(names):
    # Parametrised lazily from the expected file of the installed release.
    try:
        import importlib.metadata as md

        ver = md.version("vllm")
        exp = json.loads((HERE / "expected" / f"vllm-{ver}.json").read_text())
    except Exception:  # noqa: BLE001
        return []
    out = []
    for n in names:
        for key, rec in exp["backends"].get(n, {}).get("recorded_update", {}).items():
            out.append(pytest.param(n, key, "error" in rec, id=f"{n}-{key}"))
    return out


def _element_offsets(t):
    import torch

    idx = torch.zeros((), dtype=torch.long) + t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        idx = idx.unsqueeze(-1) + torch.arange(size) * stride
    return torch.sort(idx.flatten()).values


@pytest.mark.parametrize("name,alloc_key,vllm_refuses", _cases(FLASH + ("CPU_ATTN",)))
def test_compat_views_match_vllm_writer(name, alloc_key, vllm_refuses):
    compat = pytest.importorskip("compat")
    if vllm_refuses:
        with pytest.raises(Exception):
            probe_release.capture_update(name, alloc_key)
        pytest.skip(f"vLLM's own {name} writer refuses the {alloc_key} cache (recorded)")
    kv_cache, args, _kwargs, layer = probe_release.capture_update(name, alloc_key)
    head_size = probe_release.SENTINEL["head_size"]
    k, v = compat.kv_cache_views(kv_cache, head_size=head_size, backend=name,
                                 isa=getattr(layer, "isa", None) if name == "CPU_ATTN" else None)
    vk, vv = args[2], args[3]
    if name in FLASH:
        for mine, theirs in ((k, vk), (v, vv)):
            assert tuple(mine.shape) == tuple(theirs.shape)
            assert mine.stride() == theirs.stride()
            assert mine.data_ptr() == theirs.data_ptr()
            assert mine.storage_offset() == theirs.storage_offset()
    else:
        # CPU_ATTN: vLLM passes the K half / V half of each page as [B, H, N, D]; its kernel
        # stores K dim-major inside the K half, so compat's token-major K view covers the
        # same bytes with other strides. V is token-major in both.
        assert k.data_ptr() == vk.data_ptr() and v.data_ptr() == vv.data_ptr()
        assert (_element_offsets(k) == _element_offsets(vk)).all()
        assert (_element_offsets(v) == _element_offsets(vv)).all()


# ---- signatures compat relies on (compat/contracts.py), against the live release ----
def _contract_cases():
    from compat.contracts import CONTRACTS

    return [pytest.param(b, c, id=f"{b}-{c.owner}.{c.method}") for b in probe_release.BACKENDS for c in CONTRACTS]


@pytest.mark.parametrize("backend,contract", _contract_cases())
def test_signature_compat_relies_on(backend, contract):
    import inspect

    try:
        _, cls = probe_release.backend_class(backend)
    except Exception as exc:  # noqa: BLE001 - test_backend_modules_import reports import failures
        pytest.skip(f"{backend} not importable: {exc}")
    owner = cls.get_impl_cls() if contract.owner == "impl" else cls.get_builder_cls()
    fn = getattr(owner, contract.method, None)
    if fn is None:
        assert contract.optional, f"{owner.__qualname__} has no {contract.method} ({contract.user} needs it)"
        # Without the method the release must say forward stores the cache itself.
        assert getattr(cls, "forward_includes_kv_cache_update", True) is True
        pytest.skip(f"{owner.__qualname__}.{contract.method} absent; forward writes the cache")
    params = list(inspect.signature(fn).parameters.values())
    names = tuple(p.name for p in params[: len(contract.leading)])
    assert names == contract.leading, f"{owner.__qualname__}.{contract.method}{inspect.signature(fn)}; {contract.user} relies on {contract.leading}"
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert all(p.kind in positional for p in params[: len(contract.leading)])
    # Everything after the leading ones must be optional: compat passes only those by position.
    rest = params[len(contract.leading):]
    assert all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in rest), (
        f"{owner.__qualname__}.{contract.method}{inspect.signature(fn)} has required parameters after {contract.leading}"
    )


def test_contract_facts_are_recorded(report, expected):
    """The recorded signatures (expected/vllm-<ver>.json ``contracts``) are the live ones; the native
    forward signatures recorded here are what the sparse impl must accept and pass through."""
    for name, exp in expected["backends"].items():
        if not exp.get("imports"):
            continue
        assert "contracts" in exp, f"expected/vllm-{expected['vllm']}.json predates the contract facts: re-record it"
        assert exp["contracts"] == probe_release.facts(report)["backends"][name]["contracts"], name
        assert exp["contracts"]["impl_forward"]["present"], f"{name}: impl has no forward"
