"""``sparse-attn eval`` pieces that need no engine: held-out prompts, scores, the report, served layers."""

from __future__ import annotations

import json
import math
import re

import pytest

from sparse_attn.calibration.errors import CalibrationError
from sparse_attn.calibration.runner import counting_mode_env, served_layers
from sparse_attn.calibration.synthetic import generate_calibration_samples
from sparse_attn.evaluation import metrics
from sparse_attn.evaluation.tasks import EVAL_TASKS, build_samples, encode_prompt


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
    cell = {"text": [" 4821937 is it", " no idea", " A, C"], "answer_logprobs": [[[-0.1, 1], [-0.3, 1]], [[-2.0, 3]], [[-0.5, 1], [-1.5, 2]]]}
    scores = metrics.sample_scores(cell, [["4821937"], ["1234567"], ["A", "B", "C"]])
    assert [s["match"] for s in scores] == [1.0, 0.0, pytest.approx(2 / 3)]
    assert [s["forced_exact"] for s in scores] == [1.0, 0.0, 0.0]
    assert scores[0]["answer_ll"] == pytest.approx(-0.2)
    assert metrics.agreement([[1, 2, 3], [4, 5, 6]], [[1, 9, 3], [4, 5, 6]]) == (5, 4, 6)
    s = metrics.summarise(scores, [{"match": 1.0, "answer_ll": 0.0, "forced_exact": 1.0}] * 3)
    assert s["n"] == 3 and s["d_match"] == pytest.approx((0 - 1 + (2 / 3 - 1)) / 3)


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
    from sparse_attn.calibration.prompts import ChatTemplatePrompts, check_lengths

    wrapped = ChatTemplatePrompts(ChatTokenizer())
    samples = generate_calibration_samples(wrapped, num_samples=4, max_seqlen=1024, min_seqlen=512, num_decode_tokens=16, seed=0)
    checked = check_lengths(samples, wrapped, max_model_len=1024, decode_tokens=16)
    for s in checked:
        ids = list(s.prompt_token_ids)
        assert ids[0] == 9999 and ids.count(9999) == 1 and ids[-1] == 9998
        assert len(ids) <= s.target_len - 16
