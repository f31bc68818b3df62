"""Serve checkpoints one after the other in one process (one vLLM engine each), greedily, and
report tokens and the sparse-attn stats RPC of each, as JSON.

    python tests/engine/feature_driver.py OUT.json CKPT [CKPT ...] [--kv-cache-dtype fp8] [--max-tokens 16]
        [--prompt-len 300] [--dtype bfloat16]

One process for several engines saves the vLLM import per engine (each engine core is its own
process, so the engines do not share state). A script, not a test: vLLM's engine processes need
the ``__main__`` guard. The prompts are token ids (no tokenizer round trip) longer than the
random checkpoints' windows, so windowed layers really drop keys.
"""

import argparse
import gc
import json
import random

NUM_PROMPTS = 3


def prompts(vocab: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random(0)
    # a repeated phrase with noise: attention has structure to find, and rows differ
    phrase = [rng.randrange(4, vocab) for _ in range(23)]
    out = []
    for p in range(NUM_PROMPTS):
        noisy = [t if rng.random() > 0.2 else rng.randrange(4, vocab) for t in phrase * (prompt_len // len(phrase) + 1)]
        ids = [1] + noisy[: prompt_len - 10 * p]
        out.append(ids)
    return out


def _chosen(step: dict, token: int) -> float:
    """The logprob vLLM reports for ``token`` at one position."""
    return float(step[token].logprob)


def serve(ckpt: str, kv_cache_dtype: str, max_tokens: int, prompt_len: int, dtype: str = "float32") -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=ckpt, dtype=dtype, max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=128 << 20,
              enable_prefix_caching=False, seed=0, kv_cache_dtype=kv_cache_dtype)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    # logprobs of every prompt token (prefill attention at every position) and of each generated one
    # (decode): on random checkpoints, whose greedy tokens repeat, these are what tells layers apart
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab, prompt_len)], params, use_tqdm=False)
    try:
        stats = llm.collective_rpc("sparse_attn_stats")
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        stats = {"unavailable": str(exc)}
    report = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "prompt_logprobs": [[_chosen(step, tok) for step, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
                            for o in outputs],
        "logprobs": [[_chosen(step, tok) for step, tok in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                     for o in outputs],
        "stats": stats,
    }
    del llm
    gc.collect()
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=300, help="longest prompt, tokens (> the windows tested)")
    ap.add_argument("--dtype", default="float32", help="the model's dtype in vLLM")
    args = ap.parse_args()
    reports = {}
    for ckpt in args.checkpoints:
        try:
            reports[ckpt] = serve(ckpt, args.kv_cache_dtype, args.max_tokens, args.prompt_len, args.dtype)
        except Exception as exc:  # noqa: BLE001 - e.g. vLLM refusing the model on this machine: the test reads why
            reports[ckpt] = {"error": f"{type(exc).__name__}: {exc}"}
    with open(args.out, "w") as f:
        json.dump(reports, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
