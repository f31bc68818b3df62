#!/usr/bin/env python
"""Probe the installed vLLM release on CPU and print what its own code does, as JSON.

Usage:  python tests/matrix/tools/probe_release.py [--backends FLASHINFER,FLASH_ATTN,CPU_ATTN]

Everything printed is produced by calling the installed release (a CUDA ``vllm`` wheel
installed with --no-deps next to torch+cpu): nothing is typed in from a table.

* per backend: class path from the registry, ``forward_includes_kv_cache_update``,
  ``get_kv_cache_shape(11, 32, 3, 40)``, ``get_kv_cache_stride_order()`` with
  VLLM_KV_CACHE_LAYOUT unset / NHD / HND, ``get_required_kv_cache_layout()``,
  ``supported_kv_cache_layouts()`` and the layout vLLM's resolver picks (>= 0.29);
* the impl's constructor parameters, whether it reads the current VllmConfig, the
  ``layer.*`` / ``self.*`` attributes its ``do_kv_cache_update`` reads (AST of the real source),
  the native op it calls and the module-level name that must be replaced to intercept it;
* a real call of ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`` on a
  cache allocated the way the release's worker allocates it, with the native op replaced by a
  recorder: shapes / strides / storage offsets of the K and V cache tensors vLLM passes;
* the signatures of the impl's ``do_kv_cache_update`` / ``forward``, the metadata builder's ``build``
  and its ``get_cudagraph_support`` / ``_cudagraph_support`` (``contracts``);
* where the backend writes the cache inside ``forward`` (``forward_includes_kv_cache_update``
  True: FLASHINFER <= 0.16.0, CPU_ATTN <= 0.23): a real call of ``impl.forward`` with the
  native cache op replaced by a recorder that raises before the attention kernel, so the
  K/V cache tensors the release's own writer is given are recorded the same way;
* on >= 0.29: the per-layer views that vLLM's planner (``get_kv_cache_config_from_groups``) and
  worker (``allocate_kv_cache`` -> ``create_kv_cache_views``) build for every ``KVCacheLayout``.

The helpers are importable (``tests/matrix/test_contract.py`` uses them).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.metadata as md
import inspect
import json
import os
import sys
import textwrap
import time
import traceback
from typing import Any

SENTINEL = dict(num_blocks=11, block_size=32, num_kv_heads=3, head_size=40)
NUM_HEADS = 6  # query heads for impl construction (GQA 2:1)
BACKENDS = ("FLASHINFER", "FLASH_ATTN", "CPU_ATTN")
MODULES = (
    "vllm.v1.attention.backends.flashinfer",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.v1.attention.backends.registry",
    "vllm.v1.kv_cache_interface",
)
SLOTS = (0, 33, 69, 200, 351)  # token -> slot; 351 = last slot of 11 blocks x 32


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def tensor_info(t, base=None) -> dict:
    d = {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "storage_offset": t.storage_offset(),
        "dtype": str(t.dtype).replace("torch.", ""),
        "contiguous": t.is_contiguous(),
    }
    if base is not None:
        d["byte_offset_from_cache"] = t.data_ptr() - base.data_ptr()
        d["same_storage"] = (
            t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        )
    return d


def _describe(v, base=None):
    import torch

    if isinstance(v, torch.Tensor):
        return tensor_info(v, base)
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return repr(v)[:80]


def _describe_arg(v, cache):
    """Full layout for tensors that alias the cache, a short tag for the rest."""
    import torch

    if isinstance(v, torch.Tensor):
        if v.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr():
            return tensor_info(v, cache)
        return f"tensor{list(v.shape)}:{str(v.dtype).replace('torch.', '')}"
    return _describe(v)


def _record_first_call(out: dict, rec, kv_cache, key, value, slots) -> dict:
    """Describe the first call ``rec`` recorded (the native cache op's arguments) into ``out``."""
    out["calls"] = len(rec.calls)
    if rec.calls:
        args, kwargs = rec.calls[0]
        out["args"] = [_describe_arg(a, kv_cache) for a in args]
        out["kwargs"] = {k: _describe_arg(v, kv_cache) for k, v in kwargs.items()}
        out["args_are_inputs"] = [args[0] is key, args[1] is value, args[4] is slots]
    return out


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for dist in ("vllm", "torch", "flashinfer-python", "apache-tvm-ffi", "transformers"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def import_modules() -> dict:
    res = {}
    for m in MODULES:
        t = time.perf_counter()
        try:
            importlib.import_module(m)
            res[m] = {"ok": True, "seconds": round(time.perf_counter() - t, 2)}
        except Exception as e:  # noqa: BLE001
            res[m] = {"ok": False, "error": _err(e)}
    return res


# ----------------------------------------------------------------------------- env / config
@contextlib.contextmanager
def kv_layout_env(value: str | None):
    """Set VLLM_KV_CACHE_LAYOUT and drop vLLM's caches of it (lru_cache'd getter)."""
    old = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if value is None:
        os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    else:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = value
    _clear_layout_caches()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
        else:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = old
        _clear_layout_caches()


def _clear_layout_caches():
    try:
        import vllm.envs as envs

        for name in ("disable_envs_cache",):
            if hasattr(envs, name):
                getattr(envs, name)()
    except Exception:  # noqa: BLE001
        pass
    try:
        from vllm.v1.attention.backends import utils as bu

        f = getattr(bu, "get_kv_cache_layout", None)
        if f is not None and hasattr(f, "cache_clear"):
            f.cache_clear()
    except Exception:  # noqa: BLE001
        pass


def cpu_vllm_config():
    """A default VllmConfig that can be built without a GPU.

    Plain ``VllmConfig()`` fails on this machine (the CUDA wheel sees no platform:
    'Failed to infer device type'); an explicit DeviceConfig(device='cpu') works.
    """
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"))


# ----------------------------------------------------------------------------- backend facts
def backend_class(name: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum[name]
    return member.get_path(), member.get_class()


def _call_stride_order(cls) -> dict:
    out = {}
    fn = getattr(cls, "get_kv_cache_stride_order", None)
    if fn is None:
        return {"present": False}
    out["present"] = True
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    out["params"] = params
    for env in (None, "NHD", "HND"):
        key = env or "unset"
        with kv_layout_env(env):
            try:
                out[key] = list(fn())
            except Exception as e:  # noqa: BLE001
                out[key] = {"error": _err(e)}
            if "include_num_layers_dimension" in params:
                try:
                    out[key + "+layers"] = list(fn(include_num_layers_dimension=True))
                except Exception as e:  # noqa: BLE001
                    out[key + "+layers"] = {"error": _err(e)}
    return out


def _layouts_facts(cls) -> dict:
    out = {}
    fn = getattr(cls, "supported_kv_cache_layouts", None)
    if fn is None:
        return {"present": False}
    out["present"] = True
    try:
        r = fn()
        out["supported"] = None if r is None else [m.name for m in r]
    except Exception as e:  # noqa: BLE001
        out["supported"] = {"error": _err(e)}
    # What the engine core would resolve for a model served only by this backend.
    try:
        from vllm.v1.attention.backends import utils as bu

        for env in (None, "NHD", "HND"):
            with kv_layout_env(env):
                try:
                    names = [m.name for m in bu.get_supported_kv_cache_layouts([cls])]
                    vc = cpu_vllm_config()
                    res = bu.resolve_kv_cache_layout(vc, [names])
                    out["resolved_" + (env or "unset")] = res.name
                    out["candidates"] = names
                except Exception as e:  # noqa: BLE001
                    out["resolved_" + (env or "unset")] = {"error": _err(e)}
    except Exception as e:  # noqa: BLE001
        out["resolver"] = {"error": _err(e)}
    return out


def _source_of(fn) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def analyse_update(impl_cls) -> dict:
    """AST of the real do_kv_cache_update: attrs read on layer/self, native op called."""
    fn = getattr(impl_cls, "do_kv_cache_update", None)
    if fn is None:
        return {"present": False}
    owner = next(
        (k.__qualname__ for k in impl_cls.__mro__ if "do_kv_cache_update" in k.__dict__), None
    )
    out: dict[str, Any] = {"present": True, "defined_on": owner}
    src = _source_of(fn)
    if src is None:
        return out
    tree = ast.parse(src)
    layer_attrs, self_attrs, ops = set(), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "layer":
                layer_attrs.add(node.attr)
            elif node.value.id == "self":
                self_attrs.add(node.attr)
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name and "reshape_and_cache" in name:
                ops.append(name)
            if name and name.endswith(("unbind", "chunk", "split", "transpose", "view")):
                out.setdefault("tensor_ops", []).append(ast.unparse(node)[:120])
    out["layer_attrs"] = sorted(layer_attrs)
    out["self_attrs"] = sorted(self_attrs)
    out["native_ops"] = ops
    return out


def forward_cache_ops(impl_cls) -> list[str]:
    """How the real ``forward`` splits ``kv_cache`` into K and V (AST of its source): every call
    made on ``kv_cache`` itself, e.g. ``kv_cache.chunk(2, dim=2)``. Where ``forward`` writes the cache
    (no ``do_kv_cache_update``) this is the only record of the page format the release uses."""
    src = _source_of(getattr(impl_cls, "forward", None))
    if src is None:
        return []
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = node.func.value
            while isinstance(base, (ast.Call, ast.Attribute)):
                base = base.func if isinstance(base, ast.Call) else base.value
            if isinstance(base, ast.Name) and base.id == "kv_cache":
                out.append(ast.unparse(node)[:120])
    return out
def analyse_forward_write(impl_cls) -> dict:
    """AST of the real ``forward``: the native cache op it calls and the ``attn_metadata.*`` it reads.

    Only meaningful where the backend stores the cache inside ``forward``
    (``forward_includes_kv_cache_update`` True)."""
    fn = getattr(impl_cls, "forward", None)
    src = _source_of(fn) if fn is not None else None
    if src is None:
        return {"present": False}
    ops, meta_attrs = [], set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "attn_metadata":
            meta_attrs.add(node.attr)
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name and "reshape_and_cache" in name:
                ops.append(name)
    return {"present": bool(ops), "native_ops": ops, "metadata_attrs": sorted(meta_attrs)}


def resolve_patch_target(module, dotted: str):
    """(owner object, attribute) that the backend module looks `dotted` up through."""
    parts = dotted.split(".")
    if len(parts) == 1:
        return module, parts[0]  # module global (may not exist on CPU; patch creates it)
    obj = module.__dict__[parts[0]]
    for p in parts[1:-1]:
        obj = getattr(obj, p)
    return obj, parts[-1]


class Recorder:
    def __init__(self):
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


class StopBeforeKernel(Exception):
    """Raised by ``StoppingRecorder`` once the native cache op was called: ``forward``
    must not go on to the attention kernel (not present in a CUDA wheel on CPU)."""


class StoppingRecorder(Recorder):
    def __call__(self, *args, **kwargs):
        super().__call__(*args, **kwargs)
        raise StopBeforeKernel


@contextlib.contextmanager
def patched(owner, attr, value):
    missing = object()
    old = owner.__dict__.get(attr, missing) if hasattr(owner, "__dict__") else missing
    setattr(owner, attr, value)
    try:
        yield
    finally:
        if old is missing:
            try:
                delattr(owner, attr)
            except AttributeError:
                pass
        else:
            setattr(owner, attr, old)


class FakeLayer:
    """Stand-in for vllm's Attention layer; logs every attribute the impl reads."""

    def __init__(self, **attrs):
        object.__setattr__(self, "_values", dict(attrs))
        object.__setattr__(self, "reads", [])

    def __getattr__(self, name):
        vals = object.__getattribute__(self, "_values")
        object.__getattribute__(self, "reads").append(name)
        if name in vals:
            return vals[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        object.__getattribute__(self, "_values")[name] = value


def fake_layer():
    import torch

    return FakeLayer(
        _k_scale=torch.tensor(1.0),
        _v_scale=torch.tensor(1.0),
        _q_scale=torch.tensor(1.0),
        _k_scale_float=1.0,
        _v_scale_float=1.0,
        _q_scale_float=1.0,
        isa="vec",
        kv_cache_dtype="auto",
    )


def fake_metadata(query, slot_mapping) -> FakeLayer:
    """Stand-in for the backend's attention metadata; logs reads like ``FakeLayer``.

    Holds what the forward paths read before their cache write (FI 0.15/0.16:
    q_data_type, num_actual_tokens, prefill/decode (None = not TRT-LLM), slot_mapping;
    CPU <= 0.23: num_actual_tokens, slot_mapping, isa). Anything else raises AttributeError."""
    return FakeLayer(
        q_data_type=query.dtype,
        num_actual_tokens=query.shape[0],
        slot_mapping=slot_mapping,
        prefill=None,
        decode=None,
        isa="vec",
    )


def build_impl(impl_cls, head_size: int, num_kv_heads: int):
    """Construct the impl; first without a VllmConfig, then inside set_current_vllm_config."""
    sig = inspect.signature(impl_cls.__init__)
    kwargs = dict(
        num_heads=NUM_HEADS,
        head_size=head_size,
        scale=head_size**-0.5,
        num_kv_heads=num_kv_heads,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    kwargs = {k: v for k, v in kwargs.items() if k in sig.parameters}
    info: dict[str, Any] = {
        "init_params": [p for p in sig.parameters if p != "self"],
        "required_params": [
            n
            for n, p in sig.parameters.items()
            if n != "self" and p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ],
    }
    src = "".join(
        _source_of(k.__dict__[m]) or ""
        for k in impl_cls.__mro__
        for m in ("__init__", "__new__")
        if m in k.__dict__ and k.__module__.startswith("vllm")
    )
    info["init_reads_current_vllm_config"] = "get_current_vllm_config" in src
    try:
        impl = impl_cls(**kwargs)
        info["constructed"] = "no config"
        return impl, info
    except Exception as e:  # noqa: BLE001
        info["no_config_error"] = _err(e) + " @ " + _where(e)
    from vllm.config import set_current_vllm_config

    try:
        with set_current_vllm_config(cpu_vllm_config()):
            impl = impl_cls(**kwargs)
        info["constructed"] = "set_current_vllm_config(VllmConfig(device_config=cpu))"
        return impl, info
    except Exception as e:  # noqa: BLE001
        info["with_config_error"] = _err(e) + " @ " + _where(e)
    # Neither works on a CPU-only box: build the object without __init__ and set only
    # the attributes that the real do_kv_cache_update reads (found by AST below).
    impl = object.__new__(impl_cls)
    values = bare_impl_attrs(head_size, num_kv_heads)
    wanted = analyse_update(impl_cls).get("self_attrs", [])
    missing = [a for a in wanted if a not in values]
    for a in wanted:
        if a in values:
            setattr(impl, a, values[a])
    info["constructed"] = "bare (object.__new__ + attrs read by do_kv_cache_update)"
    info["bare_attrs_set"] = sorted(a for a in wanted if a in values)
    if missing:
        info["bare_attrs_unknown"] = missing
    return impl, info


def bare_impl_attrs(head_size: int, num_kv_heads: int) -> dict:
    from vllm.v1.attention.backend import AttentionType

    return dict(
        head_size=head_size,
        num_kv_heads=num_kv_heads,
        num_heads=NUM_HEADS,
        kv_cache_dtype="auto",
        cache_dtype="auto",
        attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        is_kvcache_nvfp4=False,
        nvfp4_fa2=False,
        isa="vec",
    )


def _where(e: BaseException) -> str:
    """file:line of the deepest frame (relative to site-packages)."""
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return "?"
    f = tb[-1]
    return f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"


# ----------------------------------------------------------------------------- cache allocation
def alloc_legacy(cls, env: str | None, dtype, num_blocks, block_size, num_kv_heads, head_size):
    """<= 0.28: mirror GPUModelRunner._reshape_kv_cache_tensors: get_kv_cache_shape, then
    view a flat buffer in stride order and permute back (identity if no stride order)."""
    import torch

    shape = tuple(cls.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
    with kv_layout_env(env):
        try:
            order = tuple(cls.get_kv_cache_stride_order())
            assert len(order) == len(shape)
        except (AttributeError, NotImplementedError):
            order = tuple(range(len(shape)))
    phys = tuple(shape[i] for i in order)
    inv = tuple(order.index(i) for i in range(len(order)))
    raw = torch.zeros(int(torch.tensor(shape).prod()), dtype=dtype)
    return raw.view(phys).permute(*inv), {"stride_order": list(order), "env": env}


def _planner():
    for mod in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, "get_kv_cache_config_from_groups"):
            return mod, m.get_kv_cache_config_from_groups
    raise ImportError("get_kv_cache_config_from_groups not found")


def alloc_views(layout_name: str, dtype, num_blocks, block_size, num_kv_heads, head_size,
                num_layers: int = 2):
    """>= 0.29: vLLM's own planner + worker allocation for one FullAttentionSpec group."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    names = [f"layers.{i}.attn" for i in range(num_layers)]
    vc = cpu_vllm_config()
    vc.cache_config.kv_cache_layout = layout.name
    planner_mod, planner = _planner()
    cfg = planner(vc, [KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
                  available_memory=spec.page_size_bytes * num_layers * num_blocks)
    caches = allocate_kv_cache(cfg, torch.device("cpu"), layout)
    meta = {
        "planner": f"{planner_mod}.get_kv_cache_config_from_groups",
        "num_blocks": cfg.num_blocks,
        "page_size_bytes": spec.page_size_bytes,
        "kv_cache_tensors": [
            {f.name: (getattr(t, f.name) if f.name != "layers" else list(t.layers))
             for f in dataclasses.fields(t)}
            for t in cfg.kv_cache_tensors
        ],
    }
    return caches, names, meta


def probe_views(dtype_name: str = "float16") -> dict:
    import torch
    from vllm.v1 import kv_cache_interface as kci

    if not hasattr(kci, "create_kv_cache_views"):
        return {"present": False}
    from vllm.v1.kv_cache_layout import KVCacheLayout

    out: dict[str, Any] = {
        "present": True,
        "KVCacheTensor_fields": [f.name for f in dataclasses.fields(kci.KVCacheTensor)],
        "FullAttentionSpec_fields": [f.name for f in dataclasses.fields(kci.FullAttentionSpec)],
        "create_kv_cache_views_params": list(
            inspect.signature(kci.create_kv_cache_views).parameters),
        "layouts": {m.name: list(m.value) for m in KVCacheLayout},
        "views": {},
    }
    s = SENTINEL
    for m in KVCacheLayout:
        try:
            caches, names, meta = alloc_views(
                m.name, getattr(torch, dtype_name), s["num_blocks"], s["block_size"],
                s["num_kv_heads"], s["head_size"])
            base = caches[names[0]]
            out["views"][m.name] = {
                "meta": meta,
                "layers": {n: tensor_info(caches[n], base) for n in names},
            }
        except Exception as e:  # noqa: BLE001
            out["views"][m.name] = {"error": _err(e)}
    return out


# ----------------------------------------------------------------------------- recording
def record_update(name: str, kv_cache, impl, analysis, head_size, num_kv_heads, dtype) -> dict:
    """Call the real impl.do_kv_cache_update with the native op replaced by a recorder."""
    import torch

    owner_cls = next(k for k in type(impl).__mro__ if "do_kv_cache_update" in k.__dict__)
    module = sys.modules[owner_cls.__module__]
    ops = analysis.get("native_ops") or []
    if not ops:
        return {"error": "no reshape_and_cache call found in do_kv_cache_update"}
    # The plain (non-nvfp4) path uses the last reshape_and_cache call in the source.
    target = ops[-1]
    owner, attr = resolve_patch_target(module, target)
    rec = Recorder()
    n_tok = len(SLOTS)
    key = torch.randn(n_tok, num_kv_heads, head_size, dtype=dtype)
    value = torch.randn(n_tok, num_kv_heads, head_size, dtype=dtype)
    slot_mapping = torch.tensor(SLOTS, dtype=torch.long)
    layer = fake_layer()
    out = {
        "patched": f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}",
        "patched_existed": attr in getattr(owner, "__dict__", {}) or hasattr(owner, attr),
        "kv_cache": tensor_info(kv_cache),
    }
    try:
        with patched(owner, attr, rec):
            impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    except Exception as e:  # noqa: BLE001
        out["error"] = _err(e)
        out["layer_reads"] = sorted(set(layer.reads))
        return out
    out["layer_reads"] = sorted(set(layer.reads))
    return _record_first_call(out, rec, kv_cache, key, value, slot_mapping)


def allocations(cls, views_present: bool) -> dict:
    """alloc key -> zero-arg function returning a fresh fp16 kv_cache for the sentinel sizes,
    allocated the way this release's worker does it."""
    import torch

    s = SENTINEL
    args = (torch.float16, s["num_blocks"], s["block_size"], s["num_kv_heads"], s["head_size"])
    if views_present:
        def views(lay):
            caches, names, _ = alloc_views(lay, *args)
            return caches[names[1]]  # the 2nd layer: a non-zero storage offset
        return {lay: (lambda lay=lay: views(lay)) for lay in ("LBNHC", "LBHNC", "BLNHC", "BLHNC")}
    return {"env=" + env: (lambda env=env: alloc_legacy(cls, env, *args)[0]) for env in ("NHD", "HND")}


def capture_update(name: str, alloc_key: str):
    """Run the real do_kv_cache_update once; return (kv_cache, recorded args, kwargs, layer).

    Raises whatever vLLM raises (e.g. the CPU view/chunk on a non-contiguous layout)."""
    import torch
    from vllm.v1 import kv_cache_interface as kci

    _, cls = backend_class(name)
    impl_cls = cls.get_impl_cls()
    analysis = analyse_update(impl_cls)
    if not analysis.get("present"):
        raise LookupError(f"{name}: no do_kv_cache_update in vLLM {versions()['vllm']}")
    s = SENTINEL
    impl, _ = build_impl(impl_cls, s["head_size"], s["num_kv_heads"])
    kv_cache = allocations(cls, hasattr(kci, "create_kv_cache_views"))[alloc_key]()
    owner_cls = next(k for k in impl_cls.__mro__ if "do_kv_cache_update" in k.__dict__)
    owner, attr = resolve_patch_target(sys.modules[owner_cls.__module__], analysis["native_ops"][-1])
    rec = Recorder()
    key = torch.randn(len(SLOTS), s["num_kv_heads"], s["head_size"], dtype=torch.float16)
    value = torch.randn_like(key)
    layer = fake_layer()
    with patched(owner, attr, rec):
        impl.do_kv_cache_update(layer, key, value, kv_cache, torch.tensor(SLOTS, dtype=torch.long))
    assert len(rec.calls) == 1, rec.calls
    args, kwargs = rec.calls[0]
    return kv_cache, args, kwargs, layer


def signature_of(fn) -> dict:
    """Every parameter of ``fn`` in order: ``[text, kind]`` with the default, no annotations."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        return {"error": _err(e)}
    return {"params": [[str(p.replace(annotation=inspect.Parameter.empty)), p.kind.name]
                       for p in sig.parameters.values()]}


def _method_facts(cls, attr: str) -> dict:
    """Signature, defining class and binding (classmethod/staticmethod/function) of ``cls.attr``."""
    if not hasattr(cls, attr):
        return {"present": False}
    owner = next((k for k in cls.__mro__ if attr in k.__dict__), None)
    raw = owner.__dict__[attr] if owner is not None else None
    kind = ("classmethod" if isinstance(raw, classmethod) else "staticmethod" if isinstance(raw, staticmethod)
            else "function" if inspect.isfunction(raw) else type(raw).__name__)
    return {"present": True, "defined_on": owner.__qualname__ if owner else None, "binding": kind,
            **signature_of(inspect.getattr_static(cls, attr).__func__ if kind == "classmethod" else getattr(cls, attr))}


def contract_facts(cls) -> dict:
    """The signatures compat relies on (compat/contracts.py) and the ones other code passes through:
    the impl's ``do_kv_cache_update`` and ``forward``, the metadata builder's ``build`` and its
    CUDA-graph support (``get_cudagraph_support`` where it exists, else the ``_cudagraph_support``
    class attribute)."""
    out: dict[str, Any] = {}
    try:
        impl_cls = cls.get_impl_cls()
        out["impl_do_kv_cache_update"] = _method_facts(impl_cls, "do_kv_cache_update")
        out["impl_forward"] = _method_facts(impl_cls, "forward")
    except Exception as e:  # noqa: BLE001
        out["impl"] = {"error": _err(e)}
    try:
        builder = cls.get_builder_cls()
    except Exception as e:  # noqa: BLE001
        out["builder"] = {"error": _err(e)}
        return out
    out["builder_class"] = f"{builder.__module__}.{builder.__qualname__}"
    out["builder_build"] = _method_facts(builder, "build")
    out["builder_get_cudagraph_support"] = _method_facts(builder, "get_cudagraph_support")
    attr_owner = next((k for k in builder.__mro__ if "_cudagraph_support" in k.__dict__), None)
    out["builder__cudagraph_support"] = (
        {"present": False} if attr_owner is None else
        {"present": True, "defined_on": attr_owner.__qualname__, "value": str(attr_owner.__dict__["_cudagraph_support"])})
    return out


def _forward_inputs(num_kv_heads: int, head_size: int, dtype):
    import torch

    n_tok = len(SLOTS)
    query = torch.randn(n_tok, NUM_HEADS, head_size, dtype=dtype)
    key = torch.randn(n_tok, num_kv_heads, head_size, dtype=dtype)
    value = torch.randn(n_tok, num_kv_heads, head_size, dtype=dtype)
    output = torch.zeros(n_tok, NUM_HEADS * head_size, dtype=dtype)
    return query, key, value, output, torch.tensor(SLOTS, dtype=torch.long)


def _run_forward_write(impl, kv_cache, analysis, head_size, num_kv_heads, dtype):
    """Call the real ``impl.forward`` with its native cache op replaced by a stopping recorder.

    Returns (recorder, layer, metadata, (key, value, slot_mapping)); raises what vLLM raises
    before the write (anything but StopBeforeKernel)."""
    module = sys.modules[type(impl).forward.__module__]
    owner, attr = resolve_patch_target(module, analysis["native_ops"][-1])
    query, key, value, output, slot_mapping = _forward_inputs(num_kv_heads, head_size, dtype)
    layer, meta = fake_layer(), fake_metadata(query, slot_mapping)
    rec = StoppingRecorder()
    with patched(owner, attr, rec):
        try:
            impl.forward(layer, query, key, value, kv_cache, meta, output=output)
        except StopBeforeKernel:
            pass
    return rec, layer, meta, (key, value, slot_mapping), f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}"


def record_forward_write(kv_cache, impl, analysis, head_size, num_kv_heads, dtype) -> dict:
    """The forward-writes counterpart of ``record_update``."""
    out: dict[str, Any] = {"kv_cache": tensor_info(kv_cache)}
    try:
        rec, layer, meta, (key, value, slots), target = _run_forward_write(
            impl, kv_cache, analysis, head_size, num_kv_heads, dtype)
    except Exception as e:  # noqa: BLE001
        out["error"] = _err(e) + " @ " + _where(e)
        return out
    out["patched"] = target
    out["layer_reads"] = sorted(set(layer.reads))
    out["metadata_reads"] = sorted(set(meta.reads))
    return _record_first_call(out, rec, kv_cache, key, value, slots)


def fresh_cache(name: str, alloc_key: str):
    """A new zeroed fp16 cache for the sentinel sizes, allocated as ``alloc_key`` says."""
    from vllm.v1 import kv_cache_interface as kci

    _, cls = backend_class(name)
    return allocations(cls, hasattr(kci, "create_kv_cache_views"))[alloc_key]()


def capture_forward_write(name: str, alloc_key: str):
    """Run the real ``forward`` up to its cache write once (the backends whose
    ``forward_includes_kv_cache_update`` is True); return
    (kv_cache, recorded args, kwargs, layer, (key, value, slot_mapping)).

    Raises whatever vLLM raises before the write."""
    import torch

    _, cls = backend_class(name)
    impl_cls = cls.get_impl_cls()
    analysis = analyse_forward_write(impl_cls)
    if not analysis.get("present"):
        raise LookupError(f"{name}: forward calls no reshape_and_cache op in vLLM {versions()['vllm']}")
    s = SENTINEL
    impl, _ = build_impl(impl_cls, s["head_size"], s["num_kv_heads"])
    kv_cache = fresh_cache(name, alloc_key)
    rec, layer, _meta, inputs, _ = _run_forward_write(
        impl, kv_cache, analysis, s["head_size"], s["num_kv_heads"], torch.float16)
    assert len(rec.calls) == 1, rec.calls
    args, kwargs = rec.calls[0]
    return kv_cache, args, kwargs, layer, inputs


def probe_backend(name: str, views_present: bool) -> dict:
    import torch

    out: dict[str, Any] = {}
    try:
        path, cls = backend_class(name)
    except Exception as e:  # noqa: BLE001
        return {"imports": False, "error": _err(e)}
    out["imports"] = True
    out["class_path"] = path
    out["forward_includes_kv_cache_update"] = getattr(
        cls, "forward_includes_kv_cache_update", "<absent>")
    out["flag_defined_on"] = next(
        (k.__qualname__ for k in cls.__mro__ if "forward_includes_kv_cache_update" in k.__dict__),
        None)
    s = SENTINEL
    if hasattr(cls, "get_kv_cache_shape"):
        try:
            out["get_kv_cache_shape"] = list(cls.get_kv_cache_shape(
                s["num_blocks"], s["block_size"], s["num_kv_heads"], s["head_size"]))
        except Exception as e:  # noqa: BLE001
            out["get_kv_cache_shape"] = {"error": _err(e)}
    else:
        out["get_kv_cache_shape"] = "<absent>"
    out["get_kv_cache_stride_order"] = _call_stride_order(cls)
    if hasattr(cls, "get_required_kv_cache_layout"):
        try:
            out["get_required_kv_cache_layout"] = cls.get_required_kv_cache_layout()
        except Exception as e:  # noqa: BLE001
            out["get_required_kv_cache_layout"] = {"error": _err(e)}
    else:
        out["get_required_kv_cache_layout"] = "<absent>"
    out["kv_cache_layouts"] = _layouts_facts(cls)
    out["contracts"] = contract_facts(cls)

    # ---- impl and do_kv_cache_update
    try:
        impl_cls = cls.get_impl_cls()
    except Exception as e:  # noqa: BLE001
        out["impl"] = {"error": _err(e)}
        return out
    analysis = analyse_update(impl_cls)
    out["do_kv_cache_update"] = analysis
    out["forward_cache_ops"] = forward_cache_ops(impl_cls)
    hs, nkv = s["head_size"], s["num_kv_heads"]
    try:
        impl, info = build_impl(impl_cls, hs, nkv)
    except Exception as e:  # noqa: BLE001
        out["impl"] = {"class": impl_cls.__qualname__, "error": _err(e)}
        return out
    out["impl"] = {"class": f"{impl_cls.__module__}.{impl_cls.__qualname__}", **info}
    if getattr(cls, "forward_includes_kv_cache_update", True):
        fwd = analyse_forward_write(impl_cls)
        out["forward_write"] = fwd
        if fwd.get("present"):
            # A fresh impl per call: FI's forward caches layer scales on its first call
            # (bmm1_scale), which would make the recorded layer reads depend on call order.
            out["recorded_forward_write"] = {
                key: record_forward_write(make(), build_impl(impl_cls, hs, nkv)[0], fwd, hs, nkv, torch.float16)
                for key, make in allocations(cls, views_present).items()
            }
    if not analysis.get("present"):
        return out
    dtype = torch.float16
    rec: dict[str, Any] = {}
    for key, make in allocations(cls, views_present).items():
        try:
            kv = make()
        except Exception as e:  # noqa: BLE001
            rec[key] = {"error": "alloc: " + _err(e)}
            continue
        rec[key] = record_update(name, kv, impl, analysis, hs, nkv, dtype)
    out["recorded_update"] = rec
    return out


def probe(backends=BACKENDS) -> dict:
    t0 = time.perf_counter()
    report: dict[str, Any] = {"versions": versions(), "sentinel": SENTINEL, "slots": SLOTS}
    report["imports"] = import_modules()
    report["import_seconds"] = round(time.perf_counter() - t0, 2)
    import torch

    torch.manual_seed(0)
    try:
        import vllm

        report["vllm.__version__"] = vllm.__version__
        from vllm.platforms import current_platform

        report["current_platform"] = type(current_platform).__name__
    except Exception as e:  # noqa: BLE001
        report["vllm.__version__"] = {"error": _err(e)}
    report["kv_cache_views"] = probe_views()
    views_present = report["kv_cache_views"].get("present", False)
    report["backends"] = {b: probe_backend(b, views_present) for b in backends}
    report["total_seconds"] = round(time.perf_counter() - t0, 2)
    return report


def facts(report: dict) -> dict:
    """The deterministic part of a probe report (what tests/matrix/expected/*.json hold)."""
    out = {"vllm": report["versions"]["vllm"], "imports": {
        m: d["ok"] for m, d in report["imports"].items()}}
    out["kv_cache_views"] = report["kv_cache_views"]
    out["backends"] = json.loads(json.dumps(report["backends"], default=str))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--facts", action="store_true",
                    help="print only the deterministic facts (the expected/*.json format)")
    a = ap.parse_args(argv)
    rep = probe(tuple(a.backends.split(",")))
    if a.facts:
        rep = facts(rep)
    text = json.dumps(rep, indent=1, sort_keys=True, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
