"""sparse_attn.calibration.export: section building and atomic checkpoint updates."""

from __future__ import annotations

import json
import math
import os
import stat

import pytest

from sparse_attn.calibration import export
from sparse_attn.calibration.export import (
    PRODUCER_NAME,
    ExportError,
    build_sparse_attention_config,
    check_checkpoint_update,
    update_checkpoint_config,
    write_json_atomic,
)
from sparse_attn.calibration.fit import FitPoint, fit_phase
from sparse_attn.config import SparseAttentionConfigError, load_from_checkpoint, parse_sparse_attention_config


def _fit(phase, a, b, target):
    pts = [FitPoint(a * math.exp(b * s), s) for s in (0.2, 0.4, 0.6, 0.8)]
    return fit_phase(pts, target, phase=phase)


@pytest.fixture
def section():
    return build_sparse_attention_config(
        {"prefill": _fit("prefill", 7.0, 8.0, 0.5), "decode": _fit("decode", 0.1, 10.0, 0.3)},
        target_classes=["LlamaAttention", "LlamaAttention"],
        ignore=["model.layers.0.self_attn"],
        producer_version="9.9.9",
    )


def test_section_layout(section):
    group = section["config_groups"]["group_0"]
    assert group["algorithm"] == "skip_softmax"
    assert group["targets"] == ["LlamaAttention"]
    assert group["ignore"] == ["model.layers.0.self_attn"]
    tsf = group["threshold_scale_factor"]
    assert tsf["formula"] == "a * exp(b * target_sparsity)"
    assert tsf["prefill"] == {"a": pytest.approx(7.0), "b": pytest.approx(8.0)}
    assert group["target_sparsity"] == {"prefill": 0.5, "decode": 0.3}
    assert section["producer"] == {"name": PRODUCER_NAME, "version": "9.9.9"}
    cfg = parse_sparse_attention_config(section)
    assert cfg.threshold("prefill", 2048) == pytest.approx(7.0 * math.exp(8.0 * 0.5) / 2048)


def test_section_with_one_phase_and_explicit_targets():
    section = build_sparse_attention_config({"prefill": (2.0, 3.0)}, {"prefill": 0.4, "decode": 0.9}, producer_version="1")
    group = section["config_groups"]["group_0"]
    assert set(group["threshold_scale_factor"]) == {"formula", "prefill"}
    assert group["target_sparsity"] == {"prefill": 0.4}
    assert "targets" not in group and "ignore" not in group
    assert parse_sparse_attention_config(section).missing_phases == ("decode",)


@pytest.mark.parametrize(
    "fits,err",
    [({}, ExportError), ({"generate": (1.0, 1.0)}, ExportError), ({"prefill": (-1.0, 1.0)}, SparseAttentionConfigError),
     ({"prefill": (float("nan"), 1.0)}, SparseAttentionConfigError)],
    ids=["no_fits", "unknown_phase", "negative_a", "nan_a"],
)
def test_build_rejects(fits, err):
    with pytest.raises(err):
        build_sparse_attention_config(fits, producer_version="1")


def _tmp_leftovers(directory):
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_write_json_atomic(tmp_path, section):
    out = write_json_atomic(tmp_path / "calib.json", section)
    assert json.loads(out.read_text()) == section
    assert out.read_text().endswith("\n")
    assert _tmp_leftovers(tmp_path) == []
    # overwriting keeps working and leaves no temp files
    write_json_atomic(out, {"x": 1})
    assert json.loads(out.read_text()) == {"x": 1} and _tmp_leftovers(tmp_path) == []


def test_write_json_refuses_nan(tmp_path):
    with pytest.raises(ExportError, match="non-finite"):
        write_json_atomic(tmp_path / "x.json", {"a": float("nan")})
    assert list(tmp_path.iterdir()) == []


def test_write_into_missing_directory(tmp_path):
    with pytest.raises(ExportError, match="does not exist"):
        write_json_atomic(tmp_path / "nope" / "x.json", {})


# An earlier sparse-attn calibration of the same layers (the ordinary re-calibration case):
# same targets/ignore as the `section` fixture, older curve and producer.
ORIGINAL = {
    "architectures": ["LlamaForCausalLM"],
    "sparse_attention_config": {
        "config_groups": {"group_0": {
            "algorithm": "skip_softmax", "targets": ["LlamaAttention"], "ignore": ["model.layers.0.self_attn"],
            "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 1.5, "b": 2.5}},
            "target_sparsity": {"prefill": 0.4},
        }},
        "producer": {"name": "sparse-attn", "version": "0.0.1"},
    },
    "model_type": "llama",
    "vocab_size": 32000,
}


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(ORIGINAL, indent=2))
    os.chmod(d / "config.json", 0o640)
    return d


def test_update_replaces_section_in_place_and_keeps_everything_else(ckpt, section):
    update_checkpoint_config(ckpt, section)
    data = json.loads((ckpt / "config.json").read_text())
    assert list(data) == list(ORIGINAL)  # key order preserved, section kept in its slot
    assert {k: v for k, v in data.items() if k != "sparse_attention_config"} == {
        k: v for k, v in ORIGINAL.items() if k != "sparse_attention_config"
    }
    assert data["sparse_attention_config"] == section
    assert load_from_checkpoint(ckpt) == parse_sparse_attention_config(section)
    assert stat.S_IMODE((ckpt / "config.json").stat().st_mode) == 0o640
    assert _tmp_leftovers(ckpt) == []


def test_update_appends_new_section_last(ckpt, section):
    (ckpt / "config.json").write_text(json.dumps({"b": 1, "a": 2}))
    update_checkpoint_config(ckpt, section)
    assert list(json.loads((ckpt / "config.json").read_text())) == ["b", "a", "sparse_attention_config"]


def _explode(*_a, **_k):
    raise OSError(28, "No space left on device")


class Killed(BaseException):
    """Stands in for a signal (KeyboardInterrupt/SystemExit) arriving mid-write."""


def _kill(*_a, **_k):
    raise Killed()


@pytest.mark.parametrize(
    "target,replacement,expected",
    [("replace", _explode, ExportError), ("fsync", _explode, ExportError), ("fsync", _kill, Killed), ("chmod", _kill, Killed)],
    ids=["os.replace_fails", "fsync_fails", "killed_during_fsync", "killed_before_rename"],
)
def test_failure_mid_write_leaves_original_byte_identical(ckpt, section, monkeypatch, target, replacement, expected):
    before = (ckpt / "config.json").read_bytes()
    monkeypatch.setattr(export.os, target, replacement)
    with pytest.raises(expected) as info:
        update_checkpoint_config(ckpt, section)
    monkeypatch.undo()
    assert (ckpt / "config.json").read_bytes() == before
    assert _tmp_leftovers(ckpt) == []
    if expected is ExportError:
        assert "left unchanged" in str(info.value)


def test_partial_write_then_failure_leaves_original(ckpt, section, monkeypatch):
    """The new text is half-written into the temp file when the process dies."""
    before = (ckpt / "config.json").read_bytes()
    real_fdopen = os.fdopen

    class HalfWriter:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
            return False

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise Killed()

    monkeypatch.setattr(export.os, "fdopen", lambda fd, *a, **k: HalfWriter(real_fdopen(fd, *a, **k)))
    with pytest.raises(Killed):
        update_checkpoint_config(ckpt, section)
    assert (ckpt / "config.json").read_bytes() == before
    assert _tmp_leftovers(ckpt) == []


@pytest.mark.parametrize(
    "content,match",
    [(None, "does not exist"), ("{broken", "not valid JSON"), ("[1, 2]", "JSON list, not an object")],
    ids=["missing_config", "invalid_json", "not_an_object"],
)
def test_update_refuses_bad_config_json(ckpt, section, content, match):
    path = ckpt / "config.json"
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    with pytest.raises(ExportError, match=match):
        update_checkpoint_config(ckpt, section)
    if content is not None:
        assert path.read_text() == content
    else:
        assert not path.exists()


def test_update_refuses_missing_directory(tmp_path, section):
    with pytest.raises(ExportError, match="does not exist"):
        update_checkpoint_config(tmp_path / "nope", section)


def test_update_refuses_invalid_section_before_touching_disk(ckpt):
    before = (ckpt / "config.json").read_bytes()
    bad = {"config_groups": {"g": {"algorithm": "skip_softmax", "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 0, "b": 1}}}}}
    with pytest.raises(ExportError, match=r"invalid section .*prefill\.a"):
        update_checkpoint_config(ckpt, bad)
    assert (ckpt / "config.json").read_bytes() == before


def test_unwritable_directory_simulated(ckpt, section, monkeypatch):
    """Works as root too: the temp-file creation fails like it would on EACCES/EROFS."""
    before = (ckpt / "config.json").read_bytes()

    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(export.tempfile, "mkstemp", denied)
    monkeypatch.setattr(export.os, "access", lambda *_a, **_k: True)
    with pytest.raises(ExportError, match="not writable .*Permission denied"):
        update_checkpoint_config(ckpt, section)
    assert (ckpt / "config.json").read_bytes() == before


def test_unwritable_directory_real_chmod(ckpt, section):
    os.chmod(ckpt, 0o555)
    try:
        if os.access(ckpt, os.W_OK):
            pytest.skip("running with privileges that ignore directory permissions (e.g. root)")
        with pytest.raises(ExportError, match="not writable"):
            update_checkpoint_config(ckpt, section)
        assert json.loads((ckpt / "config.json").read_text()) == ORIGINAL
    finally:
        os.chmod(ckpt, 0o755)


KILLED_WRITER = """
import os, sys, time
from sparse_attn.calibration import export
export.os.fsync = lambda fd: time.sleep(120)  # hold the temp file open until SIGKILL
export.write_json_atomic(sys.argv[1], {"x": 1})
"""


def test_sigkill_mid_write_leaves_a_temp_file_the_next_write_removes(ckpt, section):
    """A real kill -9 (no finally runs): the litter is attributable to the dead pid
    and the next write into the directory removes it; the original is intact."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    before = (ckpt / "config.json").read_bytes()
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(ckpt / "config.json")], cwd=repo,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        deadline = time.monotonic() + 60
        while not _tmp_leftovers(ckpt) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        left = _tmp_leftovers(ckpt)
        assert len(left) == 1 and left[0].startswith(f".config.json.{export.TEMP_TAG}-{proc.pid}."), left
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert _tmp_leftovers(ckpt) == left  # SIGKILL: nothing cleaned up
    assert (ckpt / "config.json").read_bytes() == before
    update_checkpoint_config(ckpt, section)
    assert _tmp_leftovers(ckpt) == []
    assert json.loads((ckpt / "config.json").read_text())["sparse_attention_config"] == section


def test_stale_cleanup_keeps_live_and_foreign_files(tmp_path):
    mine = tmp_path / f".out.json.{export.TEMP_TAG}-{os.getpid()}.x1.tmp"
    foreign = tmp_path / ".out.json.x2.tmp"
    other_tool = tmp_path / f".out.json.other-{os.getpid()}.x3.tmp"
    for p in (mine, foreign, other_tool):
        p.write_text("")
    assert export.remove_stale_temp_files(tmp_path) == []
    assert all(p.exists() for p in (mine, foreign, other_tool))


# --------------------------------------------------------------------------- #
# issue 9.4: the section is shared; merge into it, never destroy what is not ours
# --------------------------------------------------------------------------- #
# config.json texts written by hand, as the models / ModelOpt ship them.
MINIMAX_CONFIG = """{
  "architectures": ["MiniMaxM3ForCausalLM"],
  "model_type": "minimax_m3",
  "sparse_attention_config": {
    "use_sparse_attention": true,
    "sparse_topk_blocks": 16,
    "sparse_block_size": 64,
    "sparse_attention_layers": [1, 3, 5]
  },
  "vocab_size": 200064
}
"""


@pytest.mark.parametrize("text", [
    MINIMAX_CONFIG,
    '{"model_type": "x", "sparse_attention_config": "dense"}\n',
    '{"model_type": "x", "sparse_attention_config": {"config_groups": {"g": {"sparse_topk_blocks": 16}}}}\n',
], ids=["minimax-m3-section", "string-section", "groups-without-algorithm"])
def test_update_refuses_a_section_that_is_not_modelopt_metadata_and_leaves_the_file_byte_identical(tmp_path, section, text):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(text)
    before = (ckpt / "config.json").read_bytes()
    for attempt in (check_checkpoint_update, lambda d: update_checkpoint_config(d, section)):
        with pytest.raises(ExportError) as info:
            attempt(ckpt)
        message = str(info.value)
        assert "not ModelOpt metadata" in message  # what was seen
        assert "expected absent, or ModelOpt / TensorRT-LLM metadata" in message  # what was expected
        assert "drop --update_checkpoint_config" in message and "--output" in message and "by hand" in message  # the fix
        assert (ckpt / "config.json").read_bytes() == before
        assert sorted(p.name for p in ckpt.iterdir()) == ["config.json"]
    if text is MINIMAX_CONFIG:
        assert "sparse_topk_blocks" in message and "use_sparse_attention" in message


# The section the merge cases calibrate into, spelled out (it is what
# build_sparse_attention_config writes for these inputs; test_section_layout checks that writer).
NEW_CURVES = {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 2.0, "b": 3.0}, "decode": {"a": 0.5, "b": 4.0}}
NEW_TARGETS = {"prefill": 0.5, "decode": 0.5}
NEW_PRODUCER = {"name": "sparse-attn", "version": "9.9.9"}
NM_GROUP = {"algorithm": "sparse_softmax", "sparsity_n": 2, "sparsity_m": 4, "dense_sink_tokens": 0,
            "dense_recent_tokens": 64}

MERGE_CASES = {
    # ModelOpt's two-group export: skip-softmax group_0 (with a key we do not interpret) and N:M group_1,
    # plus an unknown section key. group_0's targets/ignore are ModelOpt's and are kept.
    "modelopt-two-groups": ("""{
  "model_type": "llama",
  "sparse_attention_config": {
    "config_groups": {
      "group_0": {
        "algorithm": "skip_softmax",
        "targets": ["LlamaAttention"],
        "ignore": ["model.layers.0.self_attn", "model.layers.31.*"],
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 7.9, "b": 8.6}},
        "target_sparsity": {"prefill": 0.3},
        "initial_disabled_steps": 2
      },
      "group_1": {"algorithm": "sparse_softmax", "sparsity_n": 2, "sparsity_m": 4, "dense_sink_tokens": 0, "dense_recent_tokens": 64}
    },
    "producer": {"name": "modelopt", "version": "0.37.0"},
    "export_note": {"calibration_dataset": "ruler", "samples": 64}
  },
  "vocab_size": 32000
}
""", {
        "config_groups": {
            "group_0": {"algorithm": "skip_softmax", "targets": ["LlamaAttention"],
                        "ignore": ["model.layers.0.self_attn", "model.layers.31.*"],
                        "threshold_scale_factor": NEW_CURVES, "target_sparsity": NEW_TARGETS, "initial_disabled_steps": 2},
            "group_1": NM_GROUP,
        },
        "producer": NEW_PRODUCER,
        "export_note": {"calibration_dataset": "ruler", "samples": 64},
    }),
    # The N:M group first: the skip-softmax group keeps its name and its place after it.
    # Its targets were empty (every layer): calibration's classes fill in.
    "nm-group-first": ("""{
  "model_type": "llama",
  "sparse_attention_config": {
    "config_groups": {
      "nm": {"algorithm": "sparse_softmax", "sparsity_n": 2, "sparsity_m": 4, "dense_sink_tokens": 0, "dense_recent_tokens": 64},
      "blasst": {"algorithm": "skip_softmax", "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "decode": {"a": 1.0, "b": 1.0}}}
    }
  }
}
""", {
        "config_groups": {
            "nm": NM_GROUP,
            "blasst": {"algorithm": "skip_softmax", "targets": ["LlamaAttention"], "threshold_scale_factor": NEW_CURVES,
                       "target_sparsity": NEW_TARGETS},
        },
        "producer": NEW_PRODUCER,
    }),
    # Only an N:M group, named group_0: ours is added under the next free name, the rest untouched.
    "nm-group-only": ("""{
  "model_type": "llama",
  "sparse_attention_config": {
    "config_groups": {
      "group_0": {"algorithm": "sparse_softmax", "sparsity_n": 2, "sparsity_m": 4, "dense_sink_tokens": 0, "dense_recent_tokens": 64}
    },
    "initial_disabled_steps": 5,
    "producer": {"name": "modelopt", "version": "0.37.0"}
  }
}
""", {
        "config_groups": {
            "group_0": NM_GROUP,
            "group_1": {"algorithm": "skip_softmax", "targets": ["LlamaAttention"], "threshold_scale_factor": NEW_CURVES,
                        "target_sparsity": NEW_TARGETS},
        },
        "initial_disabled_steps": 5,
        "producer": NEW_PRODUCER,
    }),
    # Legacy ModelOpt layout: the old curve/target at the section top belonged to the old
    # skip-softmax calibration and are replaced by the group's new ones.
    "legacy-softmax-skip": ("""{
  "model_type": "llama",
  "sparse_attention_config": {
    "config_groups": {"group_0": {"sparse_algo": "softmax_skip", "targets": ["LlamaAttention"]}},
    "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 3.0, "b": 1.0}},
    "target_sparse_ratio": 0.25,
    "producer": {"name": "modelopt", "version": "0.29.0"}
  }
}
""", {
        "config_groups": {
            "group_0": {"algorithm": "skip_softmax", "targets": ["LlamaAttention"], "threshold_scale_factor": NEW_CURVES,
                        "target_sparsity": NEW_TARGETS},
        },
        "producer": NEW_PRODUCER,
    }),
}


@pytest.mark.parametrize("case", list(MERGE_CASES), ids=list(MERGE_CASES))
def test_update_replaces_only_the_skip_softmax_calibration(tmp_path, case):
    text, expected_section = MERGE_CASES[case]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(text)
    original = json.loads(text)
    new = build_sparse_attention_config({"prefill": (2.0, 3.0), "decode": (0.5, 4.0)}, {"prefill": 0.5, "decode": 0.5},
                                        target_classes=["LlamaAttention"], producer_version="9.9.9")
    check_checkpoint_update(ckpt)  # the pre-flight accepts what the update accepts
    update_checkpoint_config(ckpt, new)
    data = json.loads((ckpt / "config.json").read_text())
    assert list(data) == list(original)
    assert {k: v for k, v in data.items() if k != "sparse_attention_config"} == {
        k: v for k, v in original.items() if k != "sparse_attention_config"}
    assert data["sparse_attention_config"] == expected_section
    assert list(data["sparse_attention_config"]["config_groups"]) == list(expected_section["config_groups"])  # group order
    assert _tmp_leftovers(ckpt) == []


def test_update_refuses_a_malformed_skip_softmax_group_before_and_after(tmp_path, section):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    text = ('{"sparse_attention_config": {"config_groups": {"g": {"algorithm": "skip_softmax", '
            '"threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": -1, "b": 1}}}}}}\n')
    (ckpt / "config.json").write_text(text)
    for attempt in (check_checkpoint_update, lambda d: update_checkpoint_config(d, section)):
        with pytest.raises(ExportError, match=r"malformed skip-softmax group .*prefill\.a.* Fix: drop --update_checkpoint_config"):
            attempt(ckpt)
        assert (ckpt / "config.json").read_text() == text
