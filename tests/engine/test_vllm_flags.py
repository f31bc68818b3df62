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
