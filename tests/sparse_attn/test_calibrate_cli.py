"""`sparse-attn calibrate` failure paths that must be caught before vLLM (or
transformers) is imported, and must leave --output and the checkpoint untouched."""

from __future__ import annotations

import json
import os
import sys

import pytest

from sparse_attn.cli import main


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, indent=2))
    return d


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    # An import of vLLM or transformers now fails loudly: the checks below must run first.
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "transformers", None)


def run(capsys, *argv):
    code = main(["calibrate", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_nothing_written(ckpt, output, before):
    assert not os.path.exists(output)
    assert (ckpt / "config.json").read_text() == before
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json"]


def test_sample_longer_than_max_model_len(ckpt, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt_token_ids": list(range(1, 201))}) + "\n"
                    + json.dumps({"prompt_token_ids": list(range(1, 1001))}) + "\n")
    out = tmp_path / "out.json"
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--prompts_file", data, "--max_model_len", 512, "--decode_tokens", 8,
                    "--output", out, "--update_checkpoint_config")
    assert code == 2
    assert "sample 1" in msg and "1000 tokens + 8 decode tokens > --max_model_len 512" in msg
    assert f"{data}:2" in msg  # names the file and line
    assert_nothing_written(ckpt, out, before)


def test_empty_calib_data_dir(ckpt, tmp_path, capsys):
    empty = tmp_path / "calib"
    empty.mkdir()
    out = tmp_path / "out.json"
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--calib_data_dir", empty, "--output", out, "--update_checkpoint_config")
    assert code == 2
    assert "no samples.jsonl in the calibration directory" in msg and str(empty) in msg
    assert_nothing_written(ckpt, out, before)


def test_calib_data_dir_with_only_blank_lines(ckpt, tmp_path, capsys):
    d = tmp_path / "calib"
    d.mkdir()
    (d / "samples.jsonl").write_text("\n\n")
    out = tmp_path / "out.json"
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--calib_data_dir", d, "--output", out)
    assert code == 2 and "the calibration set is empty" in msg
    assert_nothing_written(ckpt, out, before)


@pytest.mark.parametrize("line, expected", [
    ('{"prompt": "x"', "invalid JSON"),
    ('{"prompt": "x", "prompt_token_ids": [1, 2]}', 'needs exactly one of "prompt" or "prompt_token_ids" (found both)'),
    ('{"prompt_token_ids": [1, -2]}', '"prompt_token_ids" must be a non-empty list of non-negative integers'),
    ("42", "expected a JSON object or string, got int"),
], ids=["truncated-json", "both-keys", "negative-id", "number"])
def test_malformed_calib_data_dir(ckpt, tmp_path, capsys, line, expected):
    d = tmp_path / "calib"
    d.mkdir()
    (d / "samples.jsonl").write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n" + line + "\n")
    out = tmp_path / "out.json"
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--calib_data_dir", d, "--output", out, "--update_checkpoint_config")
    assert code == 2
    assert expected in msg and f"{d / 'samples.jsonl'}:2" in msg
    assert_nothing_written(ckpt, out, before)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_output_dir(ckpt, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        before = (ckpt / "config.json").read_text()
        code, msg = run(capsys, ckpt, "--output", locked / "out.json", "--update_checkpoint_config")
        assert code == 2
        assert f"--output {locked / 'out.json'}: directory {locked} does not exist or is not writable" in msg
        assert list(locked.iterdir()) == []
        assert_nothing_written(ckpt, locked / "out.json", before)
    finally:
        locked.chmod(0o700)


def test_missing_output_dir(ckpt, tmp_path, capsys):
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--output", tmp_path / "nope" / "out.json")
    assert code == 2 and "does not exist or is not writable" in msg
    assert not (tmp_path / "nope").exists()
    assert_nothing_written(ckpt, tmp_path / "nope" / "out.json", before)
