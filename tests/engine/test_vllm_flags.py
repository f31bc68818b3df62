"""The vLLM server flags our code passes or names exist in vLLM's own `vllm serve`
parser (the allow-list of tests/sparse_attn/test_fix_flags.py, checked at the source)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util

import pytest

from tests.sparse_attn.test_fix_flags import VLLM_SERVE_FLAG_PREFIXES, VLLM_SERVE_FLAGS

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]


def _serve_parser() -> argparse.ArgumentParser:
    # The server parser's home moved (openai/cli_args.py -> launchers/cli_args.py
    # in the 0.32 line); take whichever this release has.
    for name in ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"):
        try:
            make_arg_parser = importlib.import_module(name).make_arg_parser
            break
        except ImportError:
            continue
    else:
        pytest.fail("vLLM's make_arg_parser was not found in its known modules")
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # releases before the vllm.utils split
        from vllm.utils import FlexibleArgumentParser
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


@pytest.fixture(scope="module")
def vllm_options() -> set[str]:
    return {s for action in _serve_parser()._actions for s in action.option_strings}


@pytest.mark.parametrize("flag", sorted(VLLM_SERVE_FLAGS))
def test_listed_flag_is_in_vllms_serve_parser(vllm_options, flag):
    assert flag in vllm_options


@pytest.mark.parametrize("prefix", sorted(VLLM_SERVE_FLAG_PREFIXES))
def test_listed_prefix_matches_a_vllm_flag(vllm_options, prefix):
    assert any(option.startswith(prefix) for option in vllm_options)


# --------------------------------------------------------------------------- #
# compat.launch reads the server flags as vLLM's own parser does (issue 18 item 9)
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def serve_parser() -> argparse.ArgumentParser:
    return _serve_parser()


@pytest.mark.parametrize("value", ["4096", "32k", "32K", "25.6k", "auto", "-1"])
def test_max_model_len_is_read_as_vllm_reads_it(serve_parser, value):
    from compat.launch import read_server_args

    theirs = serve_parser.parse_args(["--max-model-len", value]).max_model_len
    ours = read_server_args(["--max-model-len", value]).max_model_len
    assert ours == (None if theirs in (-1, None) else theirs)


@pytest.mark.parametrize("args", [
    pytest.param(["--max-model", "1000"], id="abbreviated_flag"),
    pytest.param(["--max_model_len=3k"], id="underscores_and_equals"),
    pytest.param(["--hf-overrides", '{"max_position_embeddings": 8192}'], id="json_overrides"),
    pytest.param(["--hf-overrides.sparse_attention_config.config_groups.g.ignor", '["x"]',
                  "--hf-overrides.max_position_embeddings", "8k"], id="dotted_overrides"),
])
def test_server_args_are_read_as_vllm_reads_them(serve_parser, args):
    from compat.launch import read_server_args

    theirs = serve_parser.parse_args(args)
    ours = read_server_args(args)
    assert ours.max_model_len == (None if theirs.max_model_len in (-1, None) else theirs.max_model_len)
    assert dict(ours.hf_overrides or {}) == dict(theirs.hf_overrides or {})


@pytest.mark.parametrize("value", ["\u00b2", "1.5K", "lots"])
def test_lengths_vllm_refuses_are_refused(serve_parser, value):
    from compat.launch import ServerArgsError, read_server_args

    with pytest.raises(SystemExit):
        serve_parser.parse_args(["--max-model-len", value])
    with pytest.raises(ServerArgsError, match="is not a token count"):
        read_server_args(["--max-model-len", value])


def test_engine_choices_are_what_vllms_parser_offers(serve_parser):
    from compat.launch import engine_choices

    choices = engine_choices()
    dtype = next(a for a in serve_parser._actions if "--dtype" in a.option_strings)
    assert set(choices.dtypes) == set(dtype.choices)
    assert "CPU_ATTN" in choices.backends and "FLASHINFER" in choices.backends
    assert {"model", "max_model_len", "kv_cache_memory_bytes", "gpu_memory_utilization"} <= choices.kwargs


@pytest.mark.parametrize("flag,value,words", [
    ("--dtype", "nonsense", "is not a dtype vLLM"),
    ("--attention_backend", "NOPE", "is not a backend vLLM"),
    ("--engine_kwargs", '{"kv_cache_memory_byte": 1}', "(did you mean 'kv_cache_memory_bytes'?)"),
])
def test_calibrate_refuses_engine_values_this_release_rejects(tmp_path, capsys, flag, value, words):
    import json

    from sparse_attn.cli import main

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    code = main(["calibrate", str(ckpt), "--prompts_file", str(data), "--output", str(tmp_path / "out.json"), flag, value])
    out = capsys.readouterr()
    assert code == 2 and words in out.err, out.err
    assert not (tmp_path / "out.json").exists()


def test_served_cpu_worker_env_is_the_one_vllms_executor_gives_its_worker(monkeypatch):
    """compat.launch.served_cpu_worker_env (what bench_serving's in-process engine runs with) equals the OpenMP
    environment vLLM's own multiprocess executor sets for a one-worker CPU engine on this machine."""
    ompmp = pytest.importorskip("vllm.utils.ompmultiprocessing")
    import os
    import types

    from compat import launch

    for name in ("VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_SIM_MULTI_NUMA"):
        monkeypatch.delenv(name, raising=False)
    config = types.SimpleNamespace(kv_transfer_config=None, parallel_config=types.SimpleNamespace(
        local_world_size=1, data_parallel_rank_local=0, _api_process_count=1))
    names = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND")
    with ompmp.OMPProcessManager(config).configure_omp_envs(0, 0):
        vllms = {name: os.environ.get(name) for name in names}
    assert launch.served_cpu_worker_env() == vllms
