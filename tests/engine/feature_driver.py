"""Serve checkpoints one after the other in one process (one vLLM engine each), greedily, and
report tokens and the sparse-attn stats RPC of each, as JSON.

    python tests/engine/feature_driver.py OUT.json CKPT [CKPT ...] [--kv-cache-dtype fp8] [--max-tokens 16]

One process for several engines saves the vLLM import per engine (each engine core is its own
process, so the engines do not share state). A script, not a test: vLLM's engine processes need
the ``__main__`` guard. The prompts are token ids (no tokenizer round trip) longer than the
random checkpoints' windows, so windowed layers really drop keys.
"""

import argparse
import gc
import json
import random

NUM_PROMPTS, PROMPT_LEN = 3, 300


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    # a repeated phrase with noise: attention has structure to find, and rows differ
    phrase = [rng.randrange(4, vocab) for _ in range(23)]
    out = []
    for p in range(NUM_PROMPTS):
        ids = [1] + [t if rng.random() > 0.2 else rng.randrange(4, vocab) for t in (phrase * 20)][: PROMPT_LEN - 10 * p]
        out.append(ids)
    return out


def serve(ckpt: str, kv_cache_dtype: str, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=ckpt, dtype="float32", max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              enable_prefix_caching=False, seed=0, kv_cache_dtype=kv_cache_dtype)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False)
    try:
        stats = llm.collective_rpc("sparse_attn_stats")
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        stats = {"unavailable": str(exc)}
    report = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "stats": stats}
    del llm
    gc.collect()
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    reports = {}
    for ckpt in args.checkpoints:
        try:
            reports[ckpt] = serve(ckpt, args.kv_cache_dtype, args.max_tokens)
        except Exception as exc:  # noqa: BLE001 - e.g. vLLM refusing the model on this machine: the test reads why
            reports[ckpt] = {"error": f"{type(exc).__name__}: {exc}"}
    with open(args.out, "w") as f:
        json.dump(reports, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
