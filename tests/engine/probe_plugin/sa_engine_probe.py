"""vLLM general plugin + worker extension that records what an Attention impl sees.

Enabled only when SA_PROBE_DIR is set. In every process it appends a line to
$SA_PROBE_DIR/plugin_calls.txt. It wraps CPUWorker.load_model so that, right
after the model is loaded in the worker, every Attention layer is described in
$SA_PROBE_DIR/layers-<pid>.json and layer SA_PROBE_LAYER (default 0) gets a
CountingImpl that delegates to the original impl. Use
worker_extension_cls="sa_engine_probe.ProbeExt" and
llm.collective_rpc("sa_probe_stats") to fetch the records.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

STATS: dict = {"pid": os.getpid(), "events": [], "calls": {}, "none_meta": 0,
               "meta": [], "hook": None}
_MAX_META = 12


def _log(line: str) -> None:
    d = os.environ.get("SA_PROBE_DIR")
    if d:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "plugin_calls.txt"), "a") as f:
            f.write(line + "\n")


def _proc_name() -> str:
    try:
        import multiprocessing as mp
        return mp.current_process().name
    except Exception:
        return "?"


def _t(x):
    import torch
    if isinstance(x, torch.Tensor):
        d = {"shape": list(x.shape), "stride": list(x.stride()), "dtype": str(x.dtype),
             "contig": x.is_contiguous()}
        if x.numel() <= 64 and x.dtype in (torch.int32, torch.int64, torch.bool):
            d["val"] = x.tolist()
        return d
    if isinstance(x, (int, float, bool, str)) or x is None:
        return x
    return type(x).__name__


def describe_layer(name, layer) -> dict:
    impl = layer.impl
    out = {"name": name, "layer_cls": f"{type(layer).__module__}.{type(layer).__qualname__}",
           "impl_cls": f"{type(impl).__module__}.{type(impl).__qualname__}"}
    be = getattr(layer, "attn_backend", None)
    out["attn_backend"] = f"{be.__module__}.{be.__qualname__}" if be else None
    out["backend_name"] = be.get_name() if be else None
    out["forward_includes_kv_cache_update"] = getattr(be, "forward_includes_kv_cache_update", None)
    for a in ("num_heads", "num_kv_heads", "head_size", "scale", "sliding_window", "alibi_slopes",
              "logits_soft_cap", "sinks", "kv_cache_dtype", "attn_type", "isa"):
        out["impl." + a] = _t(getattr(impl, a, "<absent>"))
    for a in ("num_heads", "num_kv_heads", "head_size", "sliding_window", "kv_cache_dtype",
              "attn_type", "kv_sharing_target_layer_name", "isa", "layer_name"):
        out["layer." + a] = _t(getattr(layer, a, "<absent>"))
    kv = getattr(layer, "kv_cache", None)
    out["layer.kv_cache"] = _t(kv) if not isinstance(kv, list) else [_t(k) for k in kv]
    return out


def attention_layers(model):
    from vllm.model_executor.layers.attention.attention import Attention
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Attention)]


class CountingImpl:
    """Delegates everything to the wrapped impl; counts and records calls."""

    def __init__(self, inner, layer_name):
        self._inner = inner
        self._layer_name = layer_name

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        STATS["calls"]["do_kv_cache_update"] = STATS["calls"].get("do_kv_cache_update", 0) + 1
        STATS["events"].append("update") if len(STATS["events"]) < 40 else None
        return self._inner.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        STATS["calls"]["forward"] = STATS["calls"].get("forward", 0) + 1
        STATS["events"].append("forward" if attn_metadata is not None else "forward(meta=None)") \
            if len(STATS["events"]) < 40 else None
        if attn_metadata is None:
            STATS["none_meta"] += 1
        elif len(STATS["meta"]) < _MAX_META:
            rec = {"meta_cls": f"{type(attn_metadata).__module__}.{type(attn_metadata).__qualname__}",
                   "query": _t(query), "key": _t(key), "value": _t(value), "output": _t(output),
                   "kv_cache": _t(kv_cache), "extra_args": [str(a) for a in args],
                   "extra_kwargs": sorted(kw)}
            if dataclasses.is_dataclass(attn_metadata):
                rec["fields"] = {f.name: _t(getattr(attn_metadata, f.name))
                                 for f in dataclasses.fields(attn_metadata)}
            # Is the new V already in the cache (do_kv_cache_update ran before forward)?
            try:
                import torch
                n = attn_metadata.num_actual_tokens
                B, H, N, C = kv_cache.shape
                D = C // 2
                halves = kv_cache.view(B, H, 2 * N, D)
                vcache = halves[:, :, N:, :]
                kcache = halves[:, :, :N, :].reshape(B, H, D, N)  # K half is D-major (vec ISA)
                sm = attn_metadata.slot_mapping[:n].long()
                blk, off = sm // N, sm % N
                v_in = vcache[blk, :, off, :]  # [n, H, D]
                k_in = kcache[blk, :, :, off]  # [n, H, D]
                rec["v_in_cache_before_forward"] = bool(torch.allclose(v_in, value[:n].float(), atol=1e-5))
                rec["k_in_cache_Dmajor_before_forward"] = bool(torch.allclose(k_in, key[:n].float(), atol=1e-5))
            except Exception as e:  # noqa: BLE001
                rec["cache_check_error"] = repr(e)
            STATS["meta"].append(rec)
        ret = self._inner.forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw)
        if attn_metadata is not None and len(STATS["meta"]) <= _MAX_META and STATS["meta"]:
            STATS["meta"][-1]["returns_output_object"] = ret is output
        return ret


def install_on_model(model, which=None, tag="load_model"):
    layers = attention_layers(model)
    which = int(os.environ.get("SA_PROBE_LAYER", "0")) if which is None else which
    desc = [describe_layer(n, m) for n, m in layers]
    name, layer = layers[which]
    layer.impl = CountingImpl(layer.impl, name)
    STATS["hook"] = {"tag": tag, "pid": os.getpid(), "wrapped": name, "n_layers": len(layers),
                     "t": time.time()}
    d = os.environ.get("SA_PROBE_DIR")
    if d:
        with open(os.path.join(d, f"layers-{tag}-{os.getpid()}.json"), "w") as f:
            json.dump(desc, f, indent=1)
    return desc


def register() -> None:
    if not os.environ.get("SA_PROBE_DIR"):
        return
    _log(f"register pid={os.getpid()} ppid={os.getppid()} proc={_proc_name()} "
         f"argv0={sys.argv[0] if sys.argv else ''}")
    if os.environ.get("SA_PROBE_NO_HOOK"):
        return
    from vllm.v1.worker.cpu_worker import CPUWorker
    if getattr(CPUWorker.load_model, "_sa_probe", False):
        return
    orig = CPUWorker.load_model

    def load_model(self, *a, **kw):
        r = orig(self, *a, **kw)
        install_on_model(self.model_runner.get_model())
        _log(f"hooked pid={os.getpid()} after CPUWorker.load_model rank={getattr(self, 'rank', '?')}")
        return r

    load_model._sa_probe = True
    CPUWorker.load_model = load_model


class ProbeExt:
    """worker_extension_cls: methods become callable via llm.collective_rpc."""

    def sa_probe_stats(self):
        s = dict(STATS)
        s["rank"] = getattr(self, "rank", None)
        s["worker_cls"] = type(self).__name__
        s["worker_mro"] = [c.__name__ for c in type(self).__mro__][:6]
        layers = attention_layers(self.model_runner.get_model())
        s["kv_cache_after_init"] = [_t(m.kv_cache) for _, m in layers]
        s["impls"] = [type(m.impl).__name__ for _, m in layers]
        return s

    def sa_probe_wrap(self, which: int = 0):
        """Install the counting wrapper after the engine is up (no plugin needed)."""
        return install_on_model(self.model_runner.get_model(), which, tag="rpc")[which]
