"""``sparse-attn eval`` pieces that need no engine: held-out prompts, scores, the report, served layers."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from sparse_attn.calibration.errors import CalibrationError
from sparse_attn.calibration.runner import counting_mode_env, served_layers
from sparse_attn.evaluation import metrics
from sparse_attn.workloads.synthetic import generate_calibration_samples
from sparse_attn.workloads.tasks import EVAL_TASKS, build_samples, encode_prompt


class WordTokenizer:
    """Words and punctuation as tokens (ids from a growing table), decoding back exactly."""

    chat_template = None

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text, add_special_tokens=True):
        return [self.vocab.setdefault(p, len(self.vocab)) for p in re.findall(r"\s*\S+|\s+", text)]

    def decode(self, ids):
        inv = {v: k for k, v in self.vocab.items()}
        return "".join(inv[i] for i in ids)


class ChatTokenizer(WordTokenizer):
    chat_template = "<user>{content}</user><assistant>"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return [9999] + self.encode(messages[0]["content"]) + [9998]


@pytest.mark.parametrize("task", EVAL_TASKS)
@pytest.mark.parametrize("length", [512, 1536], ids=lambda n: f"len{n}")
def test_samples_fit_their_length_and_hold_their_answer(task, length):
    tok = WordTokenizer()
    samples = build_samples(tok, tasks=[task], lengths=[length], per_cell=2, seed=3, reserve=32)
    assert len(samples) == 2
    for s in samples:
        n = len(s.prompt_token_ids)
        assert length * 0.8 <= n <= length - 32, n
        text = tok.decode(s.prompt_token_ids)
        for answer in s.answers:
            assert answer in text  # the answer is in the context: the task is solvable
        assert s.answer_token_ids == tuple(tok.encode(s.answer_text))
        assert all(a in s.answer_text for a in s.answers)
    assert samples[0].prompt_token_ids != samples[1].prompt_token_ids


class DigitTokenizer(WordTokenizer):
    """Splits every digit off and a space before one into its own token, as SmolLM2's pre-tokenizer does."""

    def encode(self, text, add_special_tokens=True):
        parts = re.findall(r"\d| (?=\d)|\s*[^\s\d]+|\s+", text)
        return [self.vocab.setdefault(p, len(self.vocab)) for p in parts]


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey"])
def test_an_answer_never_starts_with_a_bare_space_token(task):
    """first LP must score the number, not the space a digit-splitting tokenizer puts before it."""
    tok = DigitTokenizer()
    for s in build_samples(tok, tasks=[task], lengths=[512], per_cell=2, seed=1):
        assert tok.decode(s.answer_token_ids[:1]).strip().isdigit()
        assert tok.decode(s.prompt_token_ids).endswith("is: ")  # the space moved to the prompt
        assert tok.decode([*s.prompt_token_ids, *s.answer_token_ids]).endswith("is: " + s.answers[0])
        assert s.answer_text == s.answers[0] and len(s.answer_token_ids) == 7


def test_held_out_from_calibration_for_every_seed():
    """No needle value of an eval prompt occurs in a calibration prompt of the same (or any nearby) seed."""
    tok = WordTokenizer()
    eval_numbers = {a for s in build_samples(tok, tasks=["niah_multikey", "niah_single"], lengths=[512], per_cell=4, seed=0)
                    for a in s.answers}
    for seed in range(3):
        calib = generate_calibration_samples(tok, num_samples=8, max_seqlen=1024, min_seqlen=512, seed=seed)
        numbers = {m for s in calib for m in re.findall(r"\b\d{7}\b", s.prompt)}
        assert numbers and not (numbers & eval_numbers)


def test_chat_template_ids_are_used_as_they_are():
    tok = ChatTokenizer()
    ids = encode_prompt(tok, "question", "The answer is:")
    assert ids[0] == 9999 and ids.count(9999) == 1 and 9998 in ids
    assert tok.decode([i for i in ids if i < 9998]).endswith("The answer is:")


def test_mean_ci_matches_hand_computation():
    mean, half = metrics.mean_ci([1.0, 0.0, 1.0, 1.0])
    sd = math.sqrt(((0.25 ** 2) * 3 + 0.75 ** 2) / 3)
    assert mean == 0.75 and half == pytest.approx(1.96 * sd / 2)
    assert metrics.mean_ci([]) == (None, None) and metrics.mean_ci([2.0]) == (2.0, 0.0)


def test_scores_and_agreement():
    top = lambda **lp: {str(k[1:]): v for k, v in lp.items()}  # t7=-0.1 -> {"7": -0.1}
    cell = {"text": [" 4821937 is it", " no idea", " A, C"],
            "first_step": [top(t7=-0.1, t8=-2.5), top(t9=-0.2, t8=-3.0), top(t5=-0.5, t6=-1.0)],
            "answer_logprobs": [[[-0.1, 1], [-0.3, 1]], [[-2.0, 3]], [[-0.5, 1], [-1.5, 2]]]}
    dense = {"first_step": [top(t7=-0.05, t8=-3.0), top(t9=-0.2, t8=-3.0), top(t5=-0.4, t4=-1.2)]}
    scores = metrics.sample_scores(cell, [["4821937"], ["1234567"], ["A", "B", "C"]], [[7, 1], [8], [5, 6]], dense)
    assert [s["match"] for s in scores] == [1.0, 0.0, pytest.approx(2 / 3)]
    assert [s["first_lp"] for s in scores] == [-0.1, -3.0, -0.5]
    assert [s["forced_exact"] for s in scores] == [1.0, 0.0, 0.0]
    assert scores[0]["answer_ll"] == pytest.approx(-0.2)
    assert scores[1]["kl"] == pytest.approx(0.0)
    # token 4 is missing from sparse's top-k: it gets sparse's smallest logprob (-1.0)
    assert scores[2]["kl"] == pytest.approx(math.exp(-0.4) * (-0.4 + 0.5) + math.exp(-1.2) * (-1.2 + 1.0))
    assert metrics.agreement([[1, 2, 3], [4, 5, 6]], [[1, 9, 3], [4, 5, 6]]) == (5, 4, 6)
    s = metrics.summarise(scores, [{"match": 1.0, "first_lp": 0.0, "answer_ll": 0.0, "forced_exact": 1.0}] * 3)
    assert s["n"] == 3 and s["d_match"] == pytest.approx((0 - 1 + (2 / 3 - 1)) / 3) and "kl" in s and "d_kl" not in s


def _snap(installed, total, native):
    return {"layers_installed": installed, "layers_total": total, "install": {"native": native}}


def test_served_layers_counts_the_served_ones():
    served = served_layers([_snap(3, 18, {"sliding window 512": 15})])
    assert served.installed == (3,) and served.total == (18,)
    assert "3/18" in served.describe() and "15 x sliding window 512" in served.describe()


def test_no_servable_layer_is_refused_naming_each_reason():
    with pytest.raises(CalibrationError, match=r"sliding window.*soft-cap|soft-cap.*sliding window"):
        served_layers([_snap(0, 4, {"sliding window 512": 3, "soft-cap 50": 1})])


def test_counting_mode_turns_the_periodic_log_off():
    env = counting_mode_env([0.5, 1.0])
    assert env["SPARSE_ATTN_STATS_INTERVAL_S"] == "0" and json.loads(env["SPARSE_ATTN_CALIBRATION_SCALES"]) == [0.5, 1.0]


def test_chat_wrapped_calibration_prompts_fit_their_bins():
    """--chat_template: synthetic calibration prompts sized with the template included, one BOS-like marker."""
    from sparse_attn.workloads.prompts import ChatTemplatePrompts, check_lengths

    wrapped = ChatTemplatePrompts(ChatTokenizer())
    samples = generate_calibration_samples(wrapped, num_samples=4, max_seqlen=1024, min_seqlen=512, num_decode_tokens=16, seed=0)
    checked = check_lengths(samples, wrapped, max_model_len=1024, decode_tokens=16)
    for s in checked:
        ids = list(s.prompt_token_ids)
        assert ids[0] == 9999 and ids.count(9999) == 1 and ids[-1] == 9998
        assert len(ids) <= s.target_len - 16


def test_report_puts_dense_beside_every_sparse_number(tmp_path):
    """_assemble + render on two engines' outputs (native, then a target): pooled and per-cell rows."""
    from types import SimpleNamespace

    from sparse_attn.evaluation.report import render
    from sparse_attn.evaluation.run import _assemble

    cells = [{"task": "niah_single", "length": 1024, "prompts": [[1, 2, 3], [4, 5]], "answer_ids": [[7], [8]],
              "answers": [["123"], ["456"]]}]

    def engine(texts, first, counts, gen_s):
        return {"engine_start_s": 1.0, "layers": [[30, 30]] if counts else None, "cells": [{
            "task": "niah_single", "length": 1024, "generated": [[7, 1], [8, 2]], "text": texts,
            "first_step": first, "answer_logprobs": None, "generate_s": gen_s, "teacher_forced_s": 0.0,
            "counts": counts, "teacher_forced_counts": None}]}

    dense = engine([" 123", " 456"], [{"7": -0.1}, {"8": -0.2}], None, 2.0)
    counts = {"prefill": {"skipped": 50, "visited": 100, "launches": 1, "native_launches": 0, "dense_launches": 0},
              "decode": {"skipped": 30, "visited": 60, "launches": 2, "native_launches": 0, "dense_launches": 0}}
    sparse = engine([" 123", " 999"], [{"7": -0.1}, {"8": -1.2}], counts, 3.0)
    config = SimpleNamespace(calibrated_phases=("prefill", "decode"))
    args = SimpleNamespace(checkpoint="ckpt", seed=0, samples=2, decode_tokens=2)
    report = _assemble(cells, [("dense", None), ("target 0.5", {"x": 1})], {"dense": dense, "target 0.5": sparse},
                       [0.5], config, args, None)
    pooled = report["configs"][1]["all"]
    assert pooled["match"] == 0.5 and pooled["d_match"] == -0.5 and pooled["sparsity"] == {"prefill": 0.5, "decode": 0.5}
    assert pooled["d_first_lp"] == pytest.approx(-0.5) and pooled["kl"] == pytest.approx(math.exp(-0.2) * 1.0 / 2)
    text = render(report)
    assert "dense" in text and "0.5" in text and "(1.50x)" in text and "30/30 layers sparse" in text
    native_only = _assemble(cells, [("dense", None)], {"dense": dense}, [], config, args, None)  # --targets none
    assert [c["native"] for c in native_only["configs"]] == [True] and "dense" in render(native_only)


def test_a_phase_whose_curve_never_skips_reads_dense_not_n_a():
    """Target 0.7 on a checkpoint whose prefill curve reaches lambda >= 1 (measured on SmolLM2 calibrated on 1-2k
    prompts: scale 3200 at 0.7): the prefill column says dense and why, the decode column its sparsity."""
    from sparse_attn.evaluation.report import render

    def config(label, target, never, sparsity):
        cell = {"task": "niah_single", "length": 1024, "n": 1, "match": 1.0, "first_lp": -0.1, "agreement": 1.0,
                "sparsity": sparsity}
        return {"label": label, "target": target, "native": target is None, "layers": [[30, 30]] if target else None,
                "never_skips": never, "cells": [cell],
                "all": {"n": 1, "match": 1.0, "first_lp": -0.1, "agreement": 1.0, "sparsity": sparsity,
                        "generate_s": 1.0, "teacher_forced_s": 0.0}}

    report = {"checkpoint": "ckpt", "tasks": ["niah_single"], "lengths": [1024], "samples_per_cell": 1,
              "decode_tokens": 2, "seed": 0,
              "configs": [config("dense", None, [], None),
                          config("target 0.7", 0.7, ["prefill"], {"prefill": None, "decode": 0.628})]}
    text = render(report)
    pooled = next(line for line in text.splitlines() if line.startswith("0.7 "))
    assert "dense" in pooled and "62.8" in pooled and "n/a" not in pooled
    assert "target 0.7: prefill" in text and "lambda = scale / kv_len >= 1" in text


def test_teacher_forced_prefill_is_the_cells_prefill():
    """With --teacher_forced the generate batch reads the prompts' KV from the prefix cache: the cell's prefill
    counts are the teacher-forced pass's, its decode counts the generate batch's, its time both passes'."""
    from types import SimpleNamespace

    from sparse_attn.evaluation.report import render
    from sparse_attn.evaluation.run import _assemble

    def c(skipped, visited):
        return {"skipped": skipped, "visited": visited, "launches": 1, "native_launches": 0, "dense_launches": 0}

    cells = [{"task": "niah_single", "length": 1024, "prompts": [[1, 2, 3]], "answer_ids": [[7, 8]], "answers": [["78"]]}]

    def engine(counts, tf_counts, gen_s, tf_s):
        return {"engine_start_s": 1.0, "layers": [[30, 30]] if counts else None, "cells": [{
            "task": "niah_single", "length": 1024, "generated": [[7, 8]], "text": ["78"], "first_step": [{"7": -0.1}],
            "answer_logprobs": [[[-0.1, 1], [-0.2, 1]]], "generate_s": gen_s, "teacher_forced_s": tf_s,
            "counts": counts, "teacher_forced_counts": tf_counts, "prefill_shared": True}]}

    sparse = engine({"prefill": c(1, 4), "decode": c(3, 10)}, {"prefill": c(60, 100), "decode": c(0, 0)}, 1.0, 4.0)
    dense = engine(None, None, 1.0, 3.0)
    report = _assemble(cells, [("dense", None), ("target 0.5", {"x": 1})], {"dense": dense, "target 0.5": sparse}, [0.5],
                       SimpleNamespace(calibrated_phases=("prefill", "decode")),
                       SimpleNamespace(checkpoint="ckpt", seed=0, samples=1, decode_tokens=2), None)
    pooled = report["configs"][1]["all"]
    assert pooled["sparsity"] == {"prefill": 0.6, "decode": 0.3} and pooled["counts"]["prefill"]["visited"] == 100
    assert pooled["forced_exact"] == 1.0 and pooled["d_answer_ll"] == pytest.approx(0.0)
    assert "(1.25x)" in render(report)  # (1 + 4) s against native's (1 + 3) s


def test_calib_set_tasks_is_its_own_stream_over_every_kind():
    """--calib_set tasks: the eval's kinds, round-robin over kinds and bins, none of the eval's prompts."""
    from types import SimpleNamespace

    from sparse_attn.calibration.cli import _task_samples

    tok = ChatTokenizer()
    args = SimpleNamespace(calib_samples=12, calib_min_seqlen=512, decode_tokens=16, seed=0)
    plan = SimpleNamespace(calib_max_seqlen=1024)
    calib = _task_samples(args, plan, tok)
    assert len(calib) == 12 and {s.task for s in calib} == set(EVAL_TASKS)
    assert {s.target_len for s in calib} == {1024, 512}
    assert all(len(s.prompt_token_ids) <= s.target_len - 16 for s in calib)
    held_out = build_samples(tok, tasks=EVAL_TASKS, lengths=[1024, 512], per_cell=2, seed=0)
    assert not {s.prompt_token_ids for s in calib} & {s.prompt_token_ids for s in held_out}


def test_calib_tasks_chooses_the_kinds(tmp_path):
    from types import SimpleNamespace

    from sparse_attn.calibration.cli import _task_samples

    args = SimpleNamespace(calib_samples=4, calib_min_seqlen=512, decode_tokens=16, seed=0, calib_set="tasks",
                           calib_tasks="niah_multikey,niah_single", calib_data_dir=None, prompts_file=None)
    calib = _task_samples(args, SimpleNamespace(calib_max_seqlen=1024), ChatTokenizer())
    assert [s.task for s in calib] == ["niah_multikey", "niah_single"] * 2
    assert [s.target_len for s in calib] == [1024, 1024, 512, 512]


def test_workdir_resumes_only_an_engine_whose_job_is_unchanged(tmp_path, monkeypatch):
    """--workdir: a finished engine of the same job is read back, not started; a changed job (another target,
    other prompts) or a missing output starts the engine; each start is one subprocess."""
    import subprocess
    from types import SimpleNamespace

    from sparse_attn.evaluation import run

    started = []

    class FakeEngine:  # the engine subprocess needs vLLM; this writes what it would, atomically, at the end
        def __init__(self, cmd, **kwargs):
            job_path, out_path = map(Path, cmd[-2:])
            job = json.loads(job_path.read_text())
            started.append(job["section"])
            out_path.write_text(json.dumps({"cells": [{"n": len(started)}] * len(job["cells"])}))
            self.stdout = iter(f"{run.PROGRESS_PREFIX} {k + 1} {len(job['cells'])}\n" for k in range(len(job["cells"])))

        def wait(self):
            return 0

        def kill(self):
            pass

    monkeypatch.setattr(subprocess, "Popen", FakeEngine)
    bar = SimpleNamespace(n=0, update=lambda k: setattr(bar, "n", bar.n + k))
    job = {"cells": [{"prompts": [[1, 2]]}, {"prompts": [[3]]}], "section": None}
    first = run._run_engine(job, "dense", tmp_path, {}, bar)
    again = run._run_engine(job, "dense", tmp_path, {}, bar)
    assert started == [None] and again == first and bar.n == 4
    run._run_engine({**job, "section": {"t": 0.7}}, "dense", tmp_path, {}, bar)  # another job under that label
    assert started == [None, {"t": 0.7}]
    (tmp_path / "out-dense.json").unlink()
    run._run_engine({**job, "section": {"t": 0.7}}, "dense", tmp_path, {}, bar)
    assert started == [None, {"t": 0.7}, {"t": 0.7}]
