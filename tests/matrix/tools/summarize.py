#!/usr/bin/env python
"""Turn probe_release.py JSON files into the markdown tables of FINDINGS.md.

Usage: python tests/matrix/tools/summarize.py tests/matrix/expected/vllm-*.json  (or full probe_release.py JSON)
"""
import json
import sys


def _s(v):
    if isinstance(v, dict) and "error" in v:
        return "ERR " + v["error"].split(":")[0]
    if isinstance(v, list):
        return "(" + ",".join(map(str, v)) + ")"
    return str(v)


def _t(d):
    if not isinstance(d, dict):
        return str(d)
    return f"{tuple(d['shape'])} st{tuple(d['stride'])} +{d.get('byte_offset_from_cache', d.get('storage_offset'))}"


def main(paths):
    reps = [json.load(open(p)) for p in paths]
    print("| vLLM | backend | flag | get_kv_cache_shape(11,32,3,40) | stride order unset / NHD / HND "
          "| required / supported layouts; resolved unset,NHD,HND | impl built | update reads layer.* | op patched |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in reps:
        v = r["versions"]["vllm"] if "versions" in r else r["vllm"]
        for b, x in r["backends"].items():
            if not x.get("imports"):
                print(f"| {v} | {b} | import failed: {x.get('error')} |||||||")
                continue
            so = x["get_kv_cache_stride_order"]
            sos = "absent" if not so.get("present") else " / ".join(_s(so.get(k)) for k in ("unset", "NHD", "HND"))
            kl = x["kv_cache_layouts"]
            lay = _s(x["get_required_kv_cache_layout"])
            if kl.get("present"):
                lay += f"; {_s(kl.get('supported'))}; " + ",".join(
                    _s(kl.get("resolved_" + k)) for k in ("unset", "NHD", "HND"))
            upd = x.get("do_kv_cache_update", {})
            imp = x.get("impl", {})
            recs = x.get("recorded_update", {})
            first = next(iter(recs.values()), {})
            print(f"| {v} | {b} | {x['forward_includes_kv_cache_update']} | {_s(x['get_kv_cache_shape'])} | {sos} "
                  f"| {lay} | {imp.get('constructed', imp.get('error'))} "
                  f"| {','.join(upd.get('layer_attrs', [])) if upd.get('present') else 'no do_kv_cache_update'} "
                  f"| {first.get('patched', '-')} |")
    print()
    print("Recorded K / V cache args of the real do_kv_cache_update (fp16; shape, element strides, byte offset from kv_cache.data_ptr()):")
    print()
    print("| vLLM | backend | cache alloc | kv_cache given | K cache arg | V cache arg | extra args |")
    print("|---|---|---|---|---|---|---|")
    for r in reps:
        v = r["versions"]["vllm"] if "versions" in r else r["vllm"]
        for b, x in r["backends"].items():
            for lay, rec in x.get("recorded_update", {}).items():
                if "error" in rec:
                    print(f"| {v} | {b} | {lay} | {_t(rec.get('kv_cache'))} | ERR {rec['error'][:60]} | | |")
                    continue
                a = rec["args"]
                extra = [str(e) for e in a[5:]] + [f"{k}={w}" for k, w in rec.get("kwargs", {}).items()]
                print(f"| {v} | {b} | {lay} | {_t(rec['kv_cache'])} | {_t(a[2])} | {_t(a[3])} | {', '.join(extra)} |")
    print()
    print("Recorded K / V cache args of the real forward's own cache write, where forward_includes_kv_cache_update is True "
          "(fp16; native op replaced by a recorder that stops before the kernel; metadata.* = what forward read before it):")
    print()
    print("| vLLM | backend | cache alloc | kv_cache given | K cache arg | V cache arg | extra args | op patched | metadata.* read |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in reps:
        v = r["versions"]["vllm"] if "versions" in r else r["vllm"]
        for b, x in r["backends"].items():
            for lay, rec in x.get("recorded_forward_write", {}).items():
                if "error" in rec:
                    print(f"| {v} | {b} | {lay} | {_t(rec.get('kv_cache'))} | ERR {rec['error'][:60]} | | | | |")
                    continue
                a = rec["args"]
                extra = [str(e) for e in a[5:]] + [f"{k}={w}" for k, w in rec.get("kwargs", {}).items()]
                print(f"| {v} | {b} | {lay} | {_t(rec['kv_cache'])} | {_t(a[2])} | {_t(a[3])} | {', '.join(extra)} "
                      f"| {rec['patched']} | {','.join(rec.get('metadata_reads', []))} |")
    print()
    print("Per-layer views from the planner + allocate_kv_cache (>= 0.29; fp16, 2 layers; layer 1 shown):")
    print()
    print("| vLLM | layout | KVCacheTensor layer_stride/block_stride/offset (bytes) | layer.0 view | layer.1 view |")
    print("|---|---|---|---|---|")
    for r in reps:
        kv = r["kv_cache_views"]
        if not kv.get("present"):
            continue
        v = r["versions"]["vllm"] if "versions" in r else r["vllm"]
        for lay, d in kv["views"].items():
            if "error" in d:
                print(f"| {v} | {lay} | ERR {d['error']} | | |")
                continue
            t = d["meta"]["kv_cache_tensors"][0]
            ls = list(d["layers"].values())
            print(f"| {v} | {lay} | {t['layer_stride']}/{t['block_stride']}/{t['offset']} "
                  f"| {tuple(ls[0]['shape'])} st{tuple(ls[0]['stride'])} off{ls[0]['storage_offset']} "
                  f"| st{tuple(ls[1]['stride'])} off{ls[1]['storage_offset']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
