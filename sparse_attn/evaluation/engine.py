"""One eval configuration in its own process: ``python -m sparse_attn.evaluation.engine JOB OUT``.

The parent (:mod:`sparse_attn.evaluation.run`) writes ``JOB`` (JSON: checkpoint, engine settings,
the ``sparse_attention_config`` to serve or ``null`` for native vLLM, the cells of token-id
prompts; a ``--references`` job is native vLLM at its own ``dtype``, or with a ``kv_cache_dtype``)
and sets the environment (``SPARSE_ATTN_DISABLE=1`` for native); this process starts one
vLLM engine, runs each cell twice, and writes ``OUT``:

1. **generate**: the cell's prompts in one batch, greedy, ``decode_tokens`` new tokens each
   (``ignore_eos``: every configuration decodes the same number of steps); wall time and, with the
   plugin, the workers' tile counters per phase for exactly this batch (read and reset through the
   stats RPC around it);
   with the top-``TOP_K`` log-probabilities of every generated step (``steps``; vLLM's ``logprobs=K``
   returns the sampled token plus the top K, and greedy samples the argmax, so K entries): the first
   step is the distribution the answer is read from (``first_step``: its first token's logprob), every
   step feeds the KL and top-1 agreement against dense (:mod:`sparse_attn.evaluation.metrics`);
2. **teacher-forced** (``teacher_forced`` in the job, ``--teacher_forced``): prompt + answer tokens, one new
   token, ``prompt_logprobs=TOP_K``: each answer token's logprob and rank given the true tokens before it
   (``answer_logprobs``) and, at each answer position, every entry vLLM returned (``answer_top``: the top
   K plus the answer token itself when it is not among them).
   It runs *first*, computing every token (the prefill whose tile counts are the cell's prefill
   sparsity), with vLLM's prefix cache on; the generate batch then reads the prompt's full KV blocks
   from the cache and computes only the prompt's last partial block and the decode steps, so one
   prefill per prompt serves both passes (on CPU the second prefill would double the run). The
   reverse order would not work: blocks holding generated tokens equal to the answer would be cache
   hits, and vLLM returns no logprobs for cached tokens.

A fresh process per configuration: every engine starts from the same state (no compiled kernels,
caches or plugin state carried over), and the plugin reads ``SPARSE_ATTN_*`` at start-up.
Progress: one ``EVAL-PROGRESS <done> <total>`` line per cell on stdout.

Resume: after each cell the cells done so far go to ``OUT.partial`` (atomically, with the job's digest). An engine
killed mid-job (a timeout, Ctrl-C, a reboot) and started again on the same job reads them back and runs only the
cells after them, so a few-hundred-prompt eval loses at most the cell it was in; a partial file of another job is
ignored and overwritten. Each cell's numbers come from the engine run that computed it (every engine starts from
the same state, so a resumed cell is the cell an uninterrupted run computes).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

PROGRESS_PREFIX = "EVAL-PROGRESS"
#: Top log-probabilities kept at each generated step and answer position (what the KL is computed over).
TOP_K = 20


def _phase_counts(snapshots: list[dict]) -> dict[str, dict[str, int]]:
    from sparse_attn.protocol import PHASES, phase_totals

    return {phase: phase_totals(snapshots, phase) for phase in PHASES}


def _add_counts(a: dict | None, b: dict | None) -> dict | None:
    """Two batches' phase counts as one (``None``: no plugin counts)."""
    if a is None or b is None:
        return b if a is None else a
    return {phase: {k: a[phase][k] + b[phase][k] for k in a[phase]} for phase in a}


def kv_bytes_per_token(model_cfg: dict) -> int:
    """K and V of every layer of one token at float32 (what the eval engines' caches are sized by)."""
    from sparse_attn.config import text_model_config

    text = text_model_config(model_cfg)
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return 2 * text["num_hidden_layers"] * text.get("num_key_value_heads", text["num_attention_heads"]) * head * 4


def prompts_per_batch(job: dict[str, Any]) -> int:
    """How many of a cell's prompts (each up to ``max_model_len`` tokens, 25 % headroom: the sizing of
    ``kv_cache_bytes``) the job's KV cache holds at once; at least 1. Read from the checkpoint's config.json."""
    cfg = json.loads((Path(job["checkpoint"]) / "config.json").read_text(encoding="utf-8"))
    per_prompt = kv_bytes_per_token(cfg) * (int(job["max_model_len"]) + 16) * 1.25
    return max(1, int(int(job["kv_cache_bytes"]) // per_prompt))


def _answer_top(forced: Any, answer: list[int]) -> list[dict[str, float]]:
    """The returned prompt-logprob entries (token id -> logprob) at each answer position."""
    got = forced.prompt_top or ()
    if len(got) != len(answer):
        raise RuntimeError(f"teacher-forced pass returned {len(got)} answer distributions for {len(answer)} answer tokens")
    return [{str(t): lp for t, lp in d.items()} for d in got]


def _answer_logprobs(forced: Any, prompt: list[int], answer: list[int]) -> list[list[float]]:
    """``[logprob, rank]`` of each answer token given the true tokens before it."""
    got = forced.prompt_logprobs[len(prompt):] if forced.prompt_logprobs else ()
    if len(got) != len(answer) or any(x is None for x in got):
        raise RuntimeError(f"teacher-forced pass returned {len(got)} answer logprobs for {len(answer)} answer tokens "
                           f"(a prefix-cache hit would drop them; this request must compute every token)")
    return [list(x) for x in got]


def job_digest(job: dict[str, Any]) -> str:
    """What ties a partial output to its job: the job's canonical JSON, hashed."""
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()


def read_partial(path: Path | None, job: dict[str, Any]) -> dict[str, Any] | None:
    """The result so far (:func:`run_job`'s, fewer cells) of an interrupted engine of this very ``job``, or None."""
    try:
        got = json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(got, dict) or got.get("job") != job_digest(job):
        return None
    result = got.get("result")
    if not isinstance(result, dict) or not isinstance(result.get("cells"), list) or len(result["cells"]) > len(job["cells"]):
        return None
    return result


def _write_atomically(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj), encoding="utf-8")
    tmp.replace(path)


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def run_job(job: dict[str, Any], partial: Path | None = None) -> dict[str, Any]:
    """Run one job; ``job_s`` in the result: its wall time from before vLLM's import to the last cell (engine start
    included: what the eval's throughput is measured on; a resumed job adds the earlier runs' seconds).
    ``partial``: where the cells done so far are kept (see Resume above)."""
    t0 = time.monotonic()
    earlier = read_partial(partial, job)
    done = earlier["cells"] if earlier else []
    earlier_s = float(earlier.get("job_s", 0.0)) if earlier else 0.0
    total = len(job["cells"])
    for k in range(len(done)):
        print(f"{PROGRESS_PREFIX} {k + 1} {total}", flush=True)
    if earlier and len(done) == total:  # killed between its last cell and the output: nothing left to run
        return earlier
    from compat import offline
    from sparse_attn.protocol import STATS_RPC
    from vllm import LLM

    sparse = job["section"] is not None
    top_k = int(job.get("top_k", TOP_K))
    forced_mode = bool(job.get("teacher_forced"))
    overrides = {"sparse_attention_config": job["section"]} if sparse else None
    t = time.monotonic()
    llm = LLM(**offline.eval_engine_kwargs(model=job["checkpoint"], dtype=job["dtype"], max_model_len=job["max_model_len"],
                                           seed=job["seed"], backend=job.get("backend"), hf_overrides=overrides,
                                           kv_cache_bytes=job["kv_cache_bytes"], prefix_caching=forced_mode,
                                           kv_cache_dtype=job.get("kv_cache_dtype"),
                                           max_step_tokens=job.get("max_step_tokens")))
    started_s = time.monotonic() - t

    def stats(reset: bool = True) -> list[dict] | None:
        return llm.collective_rpc(STATS_RPC, kwargs={"reset": reset}) if sparse else None

    # Warm-up outside every timed batch (first-call allocations, thread pools): the last 256 tokens of a prompt,
    # which start mid-text, so no prompt's prefix can hit its cached blocks (their KV, at another kv_len, has
    # other thresholds). Prompts of one task share their first 52-66 tokens (chat preamble and instruction,
    # measured on SmolLM2), so at most 64 tokens of full blocks: inside KV tile 0, which is never skipped and
    # which those rows alone see, so their KV is the same whichever prompt computed it.
    first = job["cells"][0]["prompts"][0]
    offline.generate(llm, [first[-min(len(first), 256):]], offline.sampling_params(
        max_tokens=2, read_prefix_cache=False if forced_mode else None))
    layers = None
    if sparse:
        snap = stats()
        layers = [[s["layers_installed"], s["layers_total"]] for s in snap]
    gen_params = offline.sampling_params(max_tokens=job["decode_tokens"], logprobs=top_k,
                                         read_prefix_cache=True if forced_mode else None)
    tf_params = offline.sampling_params(max_tokens=1, prompt_logprobs=top_k, read_prefix_cache=False if forced_mode else None)
    cells = list(done)
    batch = prompts_per_batch(job)
    for k, cell in enumerate(job["cells"]):
        if k < len(done):
            continue
        forced, gens, tf_s, gen_s, tf_counts, gen_counts = [] if forced_mode else None, [], 0.0, 0.0, None, None
        # The cell's prompts in batches whose KV fits the cache together: the generate pass then finds each prompt's
        # blocks where its teacher-forced pass left them (a batch over the cache evicts the first prompts' blocks
        # before their generate pass, which then prefills them again: measured 622 s instead of ~30 s for 60 x 2k).
        for b0 in range(0, len(cell["prompts"]), batch):
            prompts, answers = cell["prompts"][b0:b0 + batch], cell["answer_ids"][b0:b0 + batch]
            if forced_mode:
                t = time.monotonic()
                forced += offline.generate(llm, [p + a for p, a in zip(prompts, answers)], tf_params,
                                           prompt_top_from=[len(p) for p in prompts])
                tf_s += time.monotonic() - t
                tf_counts = _add_counts(tf_counts, _phase_counts(stats()) if sparse else None)
            t = time.monotonic()
            gens += offline.generate(llm, prompts, gen_params)
            gen_s += time.monotonic() - t
            gen_counts = _add_counts(gen_counts, _phase_counts(stats()) if sparse else None)
        cells.append({
            "task": cell["task"], "length": cell["length"],
            "generated": [list(g.token_ids) for g in gens], "text": [g.text for g in gens],
            "first_step": [{str(k): v for k, v in (g.step_logprobs or ({},))[0].items()} for g in gens],
            "steps": [[{str(k): v for k, v in step.items()} for step in (g.step_logprobs or ())] for g in gens],
            "answer_logprobs": None if forced is None else
            [_answer_logprobs(f, p, a) for f, p, a in zip(forced, cell["prompts"], cell["answer_ids"])],
            "answer_top": None if forced is None else [_answer_top(f, a) for f, a in zip(forced, cell["answer_ids"])],
            "generate_s": gen_s, "teacher_forced_s": tf_s, "counts": gen_counts, "teacher_forced_counts": tf_counts,
            "prefill_shared": forced_mode,
        })
        result = {"engine_start_s": started_s, "layers": layers, "cells": cells, "top_k": top_k,
                  "job_s": earlier_s + time.monotonic() - t0}
        if partial is not None:
            _write_atomically(partial, {"job": job_digest(job), "result": result})
        print(f"{PROGRESS_PREFIX} {k + 1} {total}", flush=True)
    return {"engine_start_s": started_s, "layers": layers, "cells": cells, "top_k": top_k,
            "job_s": earlier_s + time.monotonic() - t0}


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    out = Path(argv[1])
    result = run_job(job, partial_path(out))
    _write_atomically(out, result)
    partial_path(out).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
