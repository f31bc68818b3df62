"""`sparse-attn calibrate` failure paths that must be caught before vLLM (or
transformers) is imported, and must leave --output and the checkpoint untouched."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

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
    ('{"prompt": "x"', "is not valid JSON"),
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


# --------------------------------------------------------------------------- #
# issue 9.4: never lose a user's work; refuse before anything loads
# --------------------------------------------------------------------------- #
def token_prompts(tmp_path, *lengths):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt_token_ids": list(range(1, n + 1))}) + "\n" for n in lengths))
    return data


def test_output_naming_the_checkpoint_config_is_refused(ckpt, capsys):
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--output", ckpt / "config.json")
    assert code == 2
    assert "the checkpoint's config.json" in msg and "--update_checkpoint_config" in msg
    assert_nothing_written(ckpt, ckpt / "nothing-else.json", before)


def test_output_reaching_the_checkpoint_config_through_a_symlink_is_refused(ckpt, tmp_path, capsys):
    link = tmp_path / "report.json"
    link.symlink_to(ckpt / "config.json")
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--output", link)
    assert code == 2 and "the checkpoint's config.json" in msg
    assert (ckpt / "config.json").read_text() == before and link.is_symlink()


def test_output_naming_the_prompts_file_is_refused(ckpt, tmp_path, capsys):
    data = token_prompts(tmp_path, 10)
    before = data.read_text()
    code, msg = run(capsys, ckpt, "--prompts_file", data, "--output", data)
    assert code == 2 and "your calibration data" in msg
    assert data.read_text() == before


def test_output_replacing_another_checkpoint_file_is_refused(ckpt, capsys):
    (ckpt / "tokenizer.json").write_text('{"version": "1.0"}')
    code, msg = run(capsys, ckpt, "--output", ckpt / "tokenizer.json")
    assert code == 2 and "is inside the checkpoint" in msg and "never creates or replaces a file of the model" in msg
    assert (ckpt / "tokenizer.json").read_text() == '{"version": "1.0"}'


def test_output_naming_a_directory_is_refused(ckpt, tmp_path, capsys):
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--output", tmp_path)
    assert code == 2 and f"--output {tmp_path} is a directory" in msg
    assert_nothing_written(ckpt, tmp_path / "sparse_attn_calibration.json", before)


def test_plot_without_matplotlib_is_refused(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "out.json"
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--plot", tmp_path / "fit", "--output", out)
    assert code == 2 and "--plot" in msg and "matplotlib" in msg and "pip install matplotlib" in msg
    assert_nothing_written(ckpt, out, before)


def test_plot_naming_a_directory_is_refused(ckpt, tmp_path, capsys):
    code, msg = run(capsys, ckpt, "--plot", tmp_path, "--output", tmp_path / "out.json")
    assert code == 2 and f"--plot {tmp_path} is a directory" in msg


@pytest.mark.parametrize("given, written", [
    ("fit", ["fit_prefill.png", "fit_decode.png"]),
    ("fit.png", ["fit_prefill.png", "fit_decode.png"]),
    ("fit.PNG", ["fit_prefill.png", "fit_decode.png"]),
    ("run.v2", ["run.v2_prefill.png", "run.v2_decode.png"]),
], ids=["prefix", "png-suffix", "png-suffix-upper", "other-dot"])
def test_plot_names_one_png_per_phase_from_the_path_given(tmp_path, given, written):
    pytest.importorskip("matplotlib")
    from argparse import Namespace

    from sparse_attn.calibration.cli import _check_plot

    prefix, paths = _check_plot(Namespace(plot=str(tmp_path / given)))
    assert paths == [tmp_path / name for name in written]
    # the writer composes its file names from the returned prefix (calibrate's end: PREFIX_<phase>.png)
    assert [prefix.parent / f"{prefix.name}_{phase}.png" for phase in ("prefill", "decode")] == paths


def test_plot_naming_a_device_is_refused_before_anything_is_written(ckpt, tmp_path, capsys):
    # --plot /dev/null read as "no plots" used to write /dev/null_prefill.png and /dev/null_decode.png.
    out = tmp_path / "out.json"
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--plot", "/dev/null", "--output", out)
    assert code == 2 and "--plot /dev/null is a character device" in msg and "leave --plot out" in msg
    assert not Path("/dev/null_prefill.png").exists() and not Path("/dev/null_decode.png").exists()
    assert_nothing_written(ckpt, out, before)


@pytest.mark.parametrize("key, fix", [
    ("model", "CKPT argument"),
    ("enable_prefix_caching", "without a prefix cache"),
    ("enforce_eager", "always runs eager"),
    ("max_model_len", "--max_model_len"),
    ("tensor_parallel_size", "--tensor_parallel_size"),
    ("pipeline_parallel_size", "--pipeline_parallel_size"),
    ("dtype", "--dtype"),
])
def test_engine_kwargs_may_not_override_what_calibration_sets(ckpt, tmp_path, capsys, key, fix):
    # Synthetic data (no --prompts_file): a late check would first import the
    # poisoned transformers and fail with an ImportError instead.
    out = tmp_path / "out.json"
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, "--engine_kwargs", json.dumps({key: 1, "kv_cache_memory_bytes": 1}), "--output", out)
    assert code == 2 and f"--engine_kwargs may not set {key!r}" in msg and fix in msg
    assert "kv_cache_memory_bytes" not in msg
    assert_nothing_written(ckpt, out, before)


def test_engine_kwargs_checked_before_the_tokenizer(ckpt, tmp_path, capsys):
    code, msg = run(capsys, ckpt, "--engine_kwargs", "[1]", "--output", tmp_path / "out.json")
    assert code == 2 and "--engine_kwargs must be a JSON object" in msg


@pytest.fixture
def short_model(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    return ckpt


def test_default_calib_max_seqlen_is_clamped_to_the_model_limit(short_model, tmp_path, capsys):
    # A 2100-token prompt fits the default 16384 but not the model's 2048: the
    # clamp shows as the limit the length check applies.
    data = token_prompts(tmp_path, 100, 2100)
    code, msg = run(capsys, short_model, "--prompts_file", data, "--decode_tokens", 0, "--output", tmp_path / "out.json")
    assert code == 2
    assert "context limit is 2048 tokens (config.json max_position_embeddings)" in msg
    assert "using --calib_max_seqlen 2048 instead of the default 16384" in msg
    assert "2100 tokens + 0 decode tokens > --max_model_len 2048" in msg


@pytest.mark.parametrize("flag", ["--max_model_len", "--calib_max_seqlen"])
def test_explicit_length_over_the_model_limit_is_an_error(short_model, tmp_path, capsys, flag):
    code, msg = run(capsys, short_model, flag, 4096, "--output", tmp_path / "out.json")
    assert code == 2
    assert f"{flag} 4096 exceeds the model's context limit of 2048 tokens (config.json max_position_embeddings)" in msg
    assert f"pass {flag} 2048 or less" in msg


@pytest.mark.parametrize("value", [0, -5])
def test_max_model_len_zero_is_an_error(ckpt, tmp_path, capsys, value):
    code, msg = run(capsys, ckpt, "--max_model_len", value, "--output", tmp_path / "out.json")
    assert code == 2 and f"--max_model_len {value} must be a positive number of tokens" in msg


def test_stale_temp_file_of_a_dead_process_is_removed_at_start(ckpt, tmp_path, capsys):
    import subprocess

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    stale = ckpt / f".config.json.sparse-attn-{dead}.abc123.tmp"
    stale.write_text("{half")
    live = ckpt / f".config.json.sparse-attn-{os.getpid()}.def456.tmp"
    live.write_text("{in flight")
    foreign = ckpt / ".config.json.abc.tmp"
    foreign.write_text("not ours")
    code, msg = run(capsys, ckpt, "--max_model_len", 0, "--output", tmp_path / "out.json")
    assert code == 2  # refused after the checks, but the litter was cleared
    code, msg = run(capsys, ckpt, "--prompts_file", token_prompts(tmp_path, 5000), "--max_model_len", 1024,
                    "--output", tmp_path / "out.json")
    assert code == 2 and f"removed {stale}" in msg
    assert not stale.exists() and live.exists() and foreign.exists()


class _EngineStarted(Exception):
    pass


def test_calibrate_leaves_the_callers_environment_as_it_was(ckpt, tmp_path, capsys, monkeypatch):
    """The counting-mode scales reach the engine (it reads them when it starts) and
    are gone again after calibrate returns, even when the engine fails."""
    import types

    import compat.launch
    import sparse_attn.plugin  # imported while vllm is still poisoned: the probe sees no vLLM

    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen["env"] = os.environ.get(sparse_attn.plugin.CALIBRATION_ENV)
            seen["kwargs"] = kwargs
            raise _EngineStarted()

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=None))
    monkeypatch.setattr(compat.launch, "platform_is_cpu", lambda: False)
    monkeypatch.setenv(sparse_attn.plugin.CALIBRATION_ENV, "caller's own value")
    with pytest.raises(_EngineStarted):
        main(["calibrate", str(ckpt), "--prompts_file", str(token_prompts(tmp_path, 600, 700)), "--max_model_len", "1024",
              "--decode_tokens", "4", "--output", str(tmp_path / "out.json"), "--engine_kwargs", '{"gpu_memory_utilization": 0.5}'])
    assert json.loads(seen["env"])  # the candidate scales, as JSON
    assert os.environ[sparse_attn.plugin.CALIBRATION_ENV] == "caller's own value"
    kwargs = seen["kwargs"]
    assert kwargs["model"] == str(ckpt) and kwargs["max_model_len"] == 1024 and kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["enforce_eager"] is True and kwargs["enable_prefix_caching"] is False
    assert not (tmp_path / "out.json").exists()


# --------------------------------------------------------------------------- #
# issue 9.4: a section that is not ours, and the Qwen dual-chunk file, are refused before vLLM
# --------------------------------------------------------------------------- #
MINIMAX_CONFIG = """{
  "architectures": ["MiniMaxM3ForCausalLM"],
  "model_type": "minimax_m3",
  "sparse_attention_config": {"use_sparse_attention": true, "sparse_topk_blocks": 16, "sparse_block_size": 64}
}
"""


def test_update_checkpoint_config_refuses_a_minimax_section_before_vllm_starts(ckpt, tmp_path, capsys):
    (ckpt / "config.json").write_text(MINIMAX_CONFIG)
    before = (ckpt / "config.json").read_bytes()
    out = tmp_path / "out.json"
    # Synthetic data: had the check come later, the poisoned transformers import would fail first.
    code, msg = run(capsys, ckpt, "--output", out, "--update_checkpoint_config")
    assert code == 2
    assert "--update_checkpoint_config: refusing to update" in msg and "sparse_topk_blocks" in msg
    assert "expected absent, or ModelOpt / TensorRT-LLM metadata" in msg and "merge the report written with --output" in msg
    assert (ckpt / "config.json").read_bytes() == before
    assert not out.exists() and sorted(p.name for p in ckpt.iterdir()) == ["config.json"]


@pytest.mark.parametrize("exists", [False, True], ids=["not-there-yet", "already-there"])
def test_output_naming_the_qwen_dual_chunk_file_is_refused(ckpt, capsys, exists):
    qwen = ckpt / "sparse_attention_config.json"
    if exists:
        qwen.write_text('{"sparse_attention_enabled": true}')
    code, msg = run(capsys, ckpt, "--output", qwen)
    assert code == 2
    assert "Qwen dual-chunk attention" in msg and "dual_chunk_attention_config" in msg
    assert "Fix: pass another path (the default is ./sparse_attn_calibration.json)" in msg
    assert qwen.exists() == exists and (not exists or qwen.read_text() == '{"sparse_attention_enabled": true}')


def test_relative_output_resolving_to_the_qwen_dual_chunk_file_is_refused(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ckpt)
    code, msg = run(capsys, ckpt, "--output", "./sparse_attention_config.json")
    assert code == 2 and "Qwen dual-chunk attention" in msg
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json"]


def test_default_output_inside_the_checkpoint_is_refused(ckpt, capsys, monkeypatch):
    """Run from inside the checkpoint with the default --output: refused like every path in
    the checkpoint tree (issue 19: calibrate creates no file of the model), with the fix."""
    monkeypatch.chdir(ckpt)
    code, msg = run(capsys, ckpt, "--decode_tokens", 4)
    assert code == 2 and "--output sparse_attn_calibration.json is inside the checkpoint" in msg, msg
    assert f"Fix: pass a new file outside the checkpoint, e.g. --output {ckpt.parent / 'ckpt-sparse_attn_calibration.json'}" in msg
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json"]


@pytest.mark.parametrize("argv, expected", [
    (["--calib_tasks", "niah_single,nope"], "--calib_tasks 'niah_single,nope': unknown or empty; choose from niah_single"),
    (["--calib_tasks", ","], "unknown or empty"),
    (["--calib_set", "synthetic", "--calib_tasks", "qa"], "it needs --calib_set tasks"),
], ids=["unknown-kind", "empty", "synthetic-set"])
def test_calib_tasks_is_checked_before_anything_starts(ckpt, tmp_path, capsys, argv, expected):
    before = (ckpt / "config.json").read_text()
    code, msg = run(capsys, ckpt, *argv, "--output", tmp_path / "out.json", "--update_checkpoint_config")
    assert code == 2 and expected in msg
    assert_nothing_written(ckpt, tmp_path / "out.json", before)


def test_calibrate_defaults_are_the_evals_prompt_mix():
    """calibrate's default set is the eval's kinds, and eval's default lengths are calibrate's default bins."""
    from sparse_attn.workloads.lengths import DEFAULT_CALIB_MIN_SEQLEN, default_lengths
    from sparse_attn.cli import build_parser

    args = build_parser().parse_args(["calibrate", "ckpt"])
    assert args.calib_set == "tasks" and args.calib_tasks is None and args.calib_min_seqlen == DEFAULT_CALIB_MIN_SEQLEN
    assert default_lengths({"max_position_embeddings": 8192}) == [8192, 4096, 2048, 1024]
    assert default_lengths({"max_position_embeddings": 131072}) == [16384, 8192, 4096, 2048, 1024]
    assert default_lengths({"max_position_embeddings": 512}) == [512]
    eval_args = build_parser().parse_args(["eval", "ckpt"])
    assert eval_args.lengths is None and eval_args.decode_tokens == args.decode_tokens


# --------------------------------------------------------------------------- #
# issue 17 item 3: a curve per layer kind, written beside the one TensorRT-LLM reads
# --------------------------------------------------------------------------- #
class _Bar:
    """tqdm's progress bar as calibrate uses it (the unit env has no tqdm)."""

    def __init__(self, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        pass

    def set_postfix(self, **kwargs):
        pass


def test_calibrate_writes_the_window_curve_beside_the_global_one(ckpt, tmp_path, capsys, monkeypatch):
    """The whole command on a fake engine whose workers count like the adapter (1 global layer, 3
    sliding-window layers of 64 tokens counted at c / min(kv_len, 64)): the exported main curve is the
    fit of the global layers' counts, the window curve the fit of the windowed layers', each from the
    fake's independent per-kind reference counts."""
    import types

    import compat.launch
    from sparse_attn.calibration.fit import fit_counts
    from sparse_attn.config import parse_sparse_attention_config
    from tests.sparse_attn.test_runner import FakeLLM

    engines = []

    def make_llm(**kwargs):
        engines.append(FakeLLM(json.loads(os.environ["SPARSE_ATTN_CALIBRATION_SCALES"]), layers=1, windowed_layers=3,
                               window=64))
        return engines[-1]

    sampling = types.SimpleNamespace
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=make_llm, SamplingParams=lambda **kw: sampling(**kw)))
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=_Bar))
    monkeypatch.setattr(compat.launch, "platform_is_cpu", lambda: False)
    out = tmp_path / "out.json"
    lengths = (600, 640, 700, 760)
    code = main(["calibrate", str(ckpt), "--prompts_file", str(token_prompts(tmp_path, *lengths)), "--max_model_len", "1024",
                 "--decode_tokens", "4", "--output", str(out), "--target_sparse_ratio", "0.5", "--update_checkpoint_config"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    (llm,) = engines
    report = json.loads(out.read_text())
    config = parse_sparse_attention_config(json.loads((ckpt / "config.json").read_text())["sparse_attention_config"])
    assert config.has_window_curve
    for phase in ("prefill", "decode"):
        for kind, fits in (("global", config.group.fits), ("windowed", config.group.window_fits)):
            want = fit_counts(llm.scales, [llm.expected(n, 5, phase, kind) for n in lengths], 0.5)
            assert fits[phase].scale(0.5) == pytest.approx(want.scale_at_target, rel=1e-9), (kind, phase)
    # the two kinds really differ (the fake's windowed layers are sparser at one c: a smaller scale)
    assert config.scale_factor("prefill", windowed=True) < 0.5 * config.scale_factor("prefill")
    assert set(report["calibration_windowed"]) == {"prefill", "decode"}
    assert report["calibration_windowed"]["prefill"]["lambda"] == "scale / min(kv_len, w)"
    assert "prefill of sliding-window layers: scale = " in printed and "lambda = scale / min(kv_len, w)" in printed
