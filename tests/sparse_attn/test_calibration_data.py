"""sparse_attn.workloads.synthetic (RULER-style prompts) and .prompts (the prompt-file
format, its loader and the one length check)."""

from __future__ import annotations

import collections
import json
import re

import pytest

from sparse_attn.calibration import CalibrationError
from sparse_attn.calibration.errors import CalibrationDataError
from sparse_attn.workloads.lengths import length_bins
from sparse_attn.workloads.prompts import SAMPLES_FILE, CalibrationSample, check_lengths, load_prompts
from sparse_attn.workloads.synthetic import TASKS, generate_calibration_samples


class WhitespaceTokenizer:
    def encode(self, text: str) -> list[int]:
        return [hash(w) & 0xFFFF for w in text.split()]


class CharChunkTokenizer:
    """Roughly like a BPE tokenizer: one token per 3 characters plus a BOS."""

    def encode(self, text: str) -> list[int]:
        return [1] + [0] * ((len(text) + 2) // 3)


WS = WhitespaceTokenizer()


@pytest.mark.parametrize(
    "args,expected",
    [
        ((32768, 1024, None), [32768, 16384, 8192, 4096, 2048, 1024]),
        ((32768, 1024, 4), [32768, 16384, 8192, 4096]),
        ((3000, 1024, None), [3000, 1500]),
        ((1024, 1024, None), [1024]),
    ],
    ids=["halving_to_floor", "capped_bins", "non_power_of_two", "single_bin"],
)
def test_length_bins(args, expected):
    assert length_bins(*args) == expected


@pytest.mark.parametrize(
    "args", [(512, 1024, None), (0, 1024, None), (4096, 1024, 0), (4096.0, 1024, None)],
    ids=["below_floor", "zero_max", "zero_bins", "float_max"],
)
def test_length_bins_rejects(args):
    with pytest.raises(CalibrationDataError):
        length_bins(*args)


@pytest.fixture(scope="module")
def samples():
    return generate_calibration_samples(WS, num_samples=16, max_seqlen=8192, min_seqlen=1024, num_length_bins=4, num_decode_tokens=10, seed=7)


def test_exact_count_spread_over_bins_and_tasks(samples):
    assert len(samples) == 16
    by_pair = collections.Counter((s.target_len, s.task) for s in samples)
    assert set(by_pair) == {(b, t) for b in (8192, 4096, 2048, 1024) for t in TASKS}
    assert all(n == 1 for n in by_pair.values())


#: r-th sample of a bin: budget fraction 1 - 0.25 * u_r, u_r = base-2 van der Corput (0, 1/2, 1/4, 3/4)
STAGGER = {0: 1.0, 1: 0.875, 2: 0.9375, 3: 0.8125}


def test_prompts_fit_their_staggered_budget_and_nearly_fill_it(samples):
    for i, s in enumerate(samples):
        n = len(WS.encode(s.prompt))
        assert n == s.num_tokens
        budget = int((s.target_len - 10) * STAGGER[i // 4])
        assert n <= budget
        assert n >= 0.95 * budget, (s.task, s.target_len, n, budget)


def test_lengths_spread_within_each_bin_unless_disabled(samples):
    """Decode sparsity depends on each step's KV length: a bin's prompts must not all sit at its top."""
    for target in (8192, 4096, 2048, 1024):
        lengths = [s.num_tokens for s in samples if s.target_len == target]
        assert max(lengths) >= 0.95 * (target - 10)
        assert max(lengths) - min(lengths) >= 0.15 * target, (target, lengths)
    packed = generate_calibration_samples(WS, num_samples=16, max_seqlen=8192, min_seqlen=1024, num_length_bins=4,
                                          num_decode_tokens=10, seed=7, length_spread=0.0)
    for s in packed:
        assert 0.95 * (s.target_len - 10) <= s.num_tokens <= s.target_len - 10, (s.task, s.target_len, s.num_tokens)


def test_sample_does_not_depend_on_the_number_of_samples(samples):
    fewer = generate_calibration_samples(WS, num_samples=8, max_seqlen=8192, min_seqlen=1024, num_length_bins=4, num_decode_tokens=10, seed=7)
    assert fewer == samples[:8]


@pytest.mark.parametrize("spread", [-0.1, 1.0, True, "0.2"], ids=["negative", "one", "bool", "string"])
def test_length_spread_out_of_range_is_a_clear_error(spread):
    with pytest.raises(CalibrationDataError, match="length_spread must be a number in"):
        generate_calibration_samples(WS, num_samples=1, max_seqlen=1024, min_seqlen=1024, length_spread=spread)


def test_other_tokenizer_budget_respected():
    out = generate_calibration_samples(CharChunkTokenizer(), num_samples=4, max_seqlen=2048, min_seqlen=2048, num_decode_tokens=32, seed=1)
    for s in out:
        assert len(CharChunkTokenizer().encode(s.prompt)) <= 2048 - 32


def test_deterministic_per_seed(samples):
    again = generate_calibration_samples(WS, num_samples=16, max_seqlen=8192, min_seqlen=1024, num_length_bins=4, num_decode_tokens=10, seed=7)
    assert again == samples
    other = generate_calibration_samples(WS, num_samples=16, max_seqlen=8192, min_seqlen=1024, num_length_bins=4, num_decode_tokens=10, seed=8)
    assert [s.prompt for s in other] != [s.prompt for s in samples]


def test_answers_are_supported_by_the_text(samples):
    for s in samples:
        body = s.prompt
        if s.task == "niah_multikey":
            key = re.search(r"special magic number for (\S+) is$", body).group(1)
            assert f"special magic numbers for {key} is: {s.answers[0]}." in body
            assert body.count("One of the special magic numbers for") == 4
        elif s.task == "variable_tracking":
            value = re.search(r"assigned the value (\d+) in the text above", body).group(1)
            assert f"VAR {s.answers[0]} = {value}." in body
            for prev, cur in zip(s.answers, s.answers[1:]):
                assert f"VAR {cur} = VAR {prev}." in body
        elif s.task == "frequent_words":
            words = body.split("\n\n")[1].split()
            top3 = [w for w, _ in collections.Counter(words).most_common(3)]
            assert set(top3) == set(s.answers)
        elif s.task == "qa":
            assert s.answers[0] in body
            assert "Question:" in body


def test_bin_too_small_for_template_is_a_clear_error():
    with pytest.raises(CalibrationDataError, match="smallest prompt has .* over the budget"):
        generate_calibration_samples(WS, num_samples=1, max_seqlen=32, min_seqlen=32, num_decode_tokens=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tasks": ["niah_single"]}, "unknown calibration task"),
        ({"num_samples": 0}, "num_samples"),
        ({"num_decode_tokens": -1}, "num_decode_tokens"),
    ],
    ids=["unknown_task", "zero_samples", "negative_decode"],
)
def test_generate_rejects_bad_arguments(kwargs, match):
    with pytest.raises(CalibrationDataError, match=match):
        generate_calibration_samples(WS, max_seqlen=1024, **kwargs)


def test_error_hierarchy():
    assert issubclass(CalibrationDataError, CalibrationError)
    assert issubclass(CalibrationDataError, ValueError)


def test_synthetic_set_round_trips_through_the_documented_format(tmp_path, samples):
    """A samples.jsonl written by hand from the documented keys loads back to the same prompts."""
    d = tmp_path / "calib"
    d.mkdir()
    lines = [json.dumps({"prompt": s.prompt, "task": s.task, "target_len": s.target_len, "answers": list(s.answers)})
             for s in samples]
    (d / SAMPLES_FILE).write_text("\n".join(lines) + "\n")
    loaded = load_prompts(d)
    assert [(s.prompt, s.task, s.target_len, s.answers) for s in loaded] == [
        (s.prompt, s.task, s.target_len, s.answers) for s in samples]
    assert loaded[0].source == f"{d / SAMPLES_FILE}:1"
    checked = check_lengths(loaded, WS, max_model_len=8192, decode_tokens=10)
    assert [c.num_tokens for c in checked] == [s.num_tokens for s in samples]
    assert [list(c.prompt_token_ids) for c in checked] == [WS.encode(s.prompt) for s in samples]


def test_load_plain_text_one_prompt_per_line(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt here\n\n  \nsecond prompt\n")
    out = load_prompts(f)
    assert [s.prompt for s in out] == ["first prompt here", "second prompt"]
    assert out[1].source.endswith("prompts.txt:4")


def test_load_jsonl_with_token_ids_and_strings(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_token_ids": [1, 2, 3]}\n"just a string prompt"\n{"prompt": "x y", "task": "qa", "answers": ["y"]}\n')
    out = load_prompts(f)
    assert out[0] == CalibrationSample(prompt_token_ids=(1, 2, 3), num_tokens=3)
    assert out[1].prompt == "just a string prompt" and out[1].num_tokens is None
    checked = check_lengths(out, WS, max_model_len=10, decode_tokens=2)
    assert [c.num_tokens for c in checked] == [3, 4, 2]
    assert out[2].task == "qa" and out[2].answers == ("y",)


def test_load_json_list(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["a b", {"prompt": "c"}]))
    assert [s.prompt for s in load_prompts(f)] == ["a b", "c"]


BAD_JSONL = [
    ("malformed_json", '{"prompt": "ok"}\n{"prompt": \n', ":2", "is not valid JSON"),
    ("both_keys", '{"prompt": "a", "prompt_token_ids": [1]}\n', ":1", "found both"),
    ("neither_key", '{"text": "a"}\n', ":1", "exactly one of"),
    ("empty_prompt", '{"prompt": "   "}\n', ":1", "non-empty string"),
    ("bad_token_ids", '{"prompt_token_ids": [1, -2]}\n', ":1", "non-negative integers"),
    ("float_token_ids", '{"prompt_token_ids": [1.5]}\n', ":1", "non-negative integers"),
    ("number_line", "42\n", ":1", "JSON object or string"),
    ("bad_answers", '{"prompt": "a", "answers": [1]}\n', ":1", "answers"),
]


@pytest.mark.parametrize("content,where,what", [c[1:] for c in BAD_JSONL], ids=[c[0] for c in BAD_JSONL])
def test_malformed_jsonl_names_file_and_line(tmp_path, content, where, what):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(CalibrationDataError) as info:
        load_prompts(f)
    msg = str(info.value)
    assert f"{f}{where}" in msg and what in msg and "Fix:" in msg


def test_empty_set_is_rejected(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n\n")
    with pytest.raises(CalibrationDataError, match="empty"):
        load_prompts(f)


def test_missing_data_is_rejected(tmp_path):
    with pytest.raises(CalibrationDataError, match="no such file"):
        load_prompts(tmp_path / "nope")
    (tmp_path / "other.txt").write_text("x")
    with pytest.raises(CalibrationDataError, match=r"no samples\.jsonl .*other\.txt"):
        load_prompts(tmp_path)


def test_sample_longer_than_max_model_len(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b c"}\n{"prompt": "a b c d e f g h"}\n')
    loaded = load_prompts(f)
    with pytest.raises(CalibrationDataError) as info:
        check_lengths(loaded, WS, max_model_len=10, decode_tokens=3)
    msg = str(info.value)
    assert f"{f}:2" in msg and "8 tokens + 3 decode tokens > --max_model_len 10" in msg and "Fix:" in msg
    # the same file fits once decode tokens leave room
    assert len(check_lengths(loaded, WS, max_model_len=10, decode_tokens=2)) == 2


def test_text_prompts_need_a_tokenizer_for_length_checks(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a b c\n")
    with pytest.raises(CalibrationDataError, match="tokenizer is needed"):
        check_lengths(load_prompts(f), None, max_model_len=100, decode_tokens=0)


@pytest.mark.parametrize("max_model_len", [0, -1, True], ids=["zero", "negative", "bool"])
def test_length_check_rejects_bad_limit(max_model_len):
    with pytest.raises(CalibrationDataError, match="max_model_len must be a positive integer"):
        check_lengths([CalibrationSample(prompt_token_ids=(1,))], None, max_model_len=max_model_len, decode_tokens=0)
