"""`sparse-attn serve` validation: what it prints and refuses before vLLM starts.

Every call passes --validate-only, so a regression can never exec vLLM in place
of the test process; the engine tests (tests/engine/test_config_sources.py)
cover the same paths with a real server and a hub-ID snapshot.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys

import pytest

import compat
from sparse_attn.cli import main

SKIP = {
    "config_groups": {"group_0": {
        "algorithm": "skip_softmax",
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                   "prefill": {"a": 7.93, "b": 8.61}, "decode": {"a": 0.12, "b": 9.85}},
        "target_sparsity": {"prefill": 0.5, "decode": 0.5},
    }},
}
NM_GROUP = {"algorithm": "sparse_softmax", "sparsity_n": 2, "sparsity_m": 4, "dense_sink_tokens": 0, "dense_recent_tokens": 64}


def with_curve(phase: str, **coefs) -> dict:
    section = copy.deepcopy(SKIP)
    tsf = section["config_groups"]["group_0"]["threshold_scale_factor"]
    if "log_a" in coefs:
        tsf["formula"] = "exp(log_a + b * target_sparsity)"
        for other in ("prefill", "decode"):
            tsf[other] = {"log_a": 1.0, "b": 5.0}
    tsf[phase] = coefs
    return section


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("SPARSE_ATTN_DISABLE", "SPARSE_ATTN_STRICT"):
        monkeypatch.delenv(name, raising=False)
    # Validation must not need vLLM: an import of it fails loudly.
    monkeypatch.setitem(sys.modules, "vllm", None)
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


@pytest.fixture
def ckpt(tmp_path):
    def make(section, **config):
        d = tmp_path / "ckpt"
        d.mkdir(exist_ok=True)
        data = {"model_type": "llama", "max_position_embeddings": 2048, **config}
        if section is not None:
            data["sparse_attention_config"] = section
        (d / "config.json").write_text(json.dumps(data))
        return d
    return make


def serve(capsys, *argv):
    code = main(["serve", *map(str, argv), "--validate-only"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


HARMFUL = [
    # id, section, key path in the error
    ("b_2000", with_curve("prefill", a=7.93, b=2000), "threshold_scale_factor.prefill.b"),
    ("log_a_710", with_curve("decode", log_a=710.0, b=1.0), "threshold_scale_factor.decode.log_a"),
    ("huge_integer_a", with_curve("prefill", a=10 ** 400, b=1.0), "threshold_scale_factor.prefill.a"),
    ("nested_quantifier_regex", {**copy.deepcopy(SKIP), "config_groups": {"group_0": {
        **SKIP["config_groups"]["group_0"], "ignore": ["re:([a-z._0-9]+)*X"]}}}, "ignore"),
    ("negative_a_beside_nm_group", {"config_groups": {**with_curve("decode", a=-3, b=1.0)["config_groups"],
                                                      "group_1": NM_GROUP}}, "threshold_scale_factor.decode.a"),
]


@pytest.mark.parametrize("section,key_path", [c[1:] for c in HARMFUL], ids=[c[0] for c in HARMFUL])
def test_harmful_config_is_refused_before_vllm_with_key_path_and_the_way_out(capsys, ckpt, section, key_path):
    code, out = serve(capsys, ckpt(section), "--port", "1")
    assert code == 2, out
    assert f"sparse_attention_config.config_groups.group_0.{key_path}" in out
    assert "SPARSE_ATTN_DISABLE=1" in out and "Fix:" in out
    assert "would be" not in out and "exec" not in out
    assert "Traceback" not in out


def test_minimax_style_section_serves_natively_with_one_line(capsys, ckpt):
    code, out = serve(capsys, ckpt({"use_sparse_attention": True, "sparse_topk_blocks": 16}))
    assert code == 0
    lines = [line for line in out.splitlines() if "not ModelOpt / TensorRT-LLM skip-softmax metadata" in line]
    assert len(lines) == 1 and "warning" not in out


def test_absent_section_says_native(capsys, ckpt):
    d = ckpt(None)
    code, out = serve(capsys, d)
    # the plugin's own wording (one start-up policy), after the command's prefix
    assert code == 0 and f"sparse-attn serve: {d} has no sparse_attention_config in config.json; vLLM attention left native" in out


def test_two_group_export_validates_and_warns_about_the_group_it_does_not_serve(capsys, ckpt):
    section = copy.deepcopy(SKIP)
    section["config_groups"]["group_1"] = NM_GROUP
    code, out = serve(capsys, ckpt(section))
    assert code == 0
    assert "warning: sparse_attention_config.config_groups.group_1 (algorithm 'sparse_softmax') is not served" in out
    assert "skip-softmax group group_0 validated (target sparsity: prefill 0.5, decode 0.5)" in out


def test_strict_makes_an_unserved_group_an_error(capsys, ckpt, monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_STRICT", "1")
    section = copy.deepcopy(SKIP)
    section["config_groups"]["group_1"] = NM_GROUP
    code, out = serve(capsys, ckpt(section))
    assert code == 2
    assert "SPARSE_ATTN_STRICT=1" in out and "group_1 (algorithm 'sparse_softmax')" in out
    assert "SPARSE_ATTN_DISABLE=1" in out


NEVER_SKIP = [
    # id, section, vLLM args, expected warning
    ("a_1e6", with_curve("prefill", a=1e6, b=4.0), [], "prefill phase never skips a tile"),
    ("negative_b", with_curve("decode", a=20.0, b=-3.0), [], "threshold_scale_factor.decode.b is -3.0"),
    ("target_0.99999", {"config_groups": {"group_0": {**SKIP["config_groups"]["group_0"],
                                                      "target_sparsity": {"prefill": 0.99999, "decode": 0.5}}}},
     [], f"at target_sparsity 0.99999 the prefill scale factor is {7.93 * math.exp(8.61 * 0.99999):.4g}"),
    ("max_model_len_flag_below_scale", with_curve("prefill", a=5000.0, b=0.1), ["--max-model-len", "4096"],
     "up to 4096 tokens"),
]


@pytest.mark.parametrize("section,args,warning", [c[1:] for c in NEVER_SKIP], ids=[c[0] for c in NEVER_SKIP])
def test_config_that_can_never_skip_warns_in_validation(capsys, ckpt, section, args, warning):
    code, out = serve(capsys, ckpt(section), *args)
    assert code == 0
    assert sum(warning in line and line.startswith("sparse-attn serve: warning:") for line in out.splitlines()) == 1, out


def test_max_model_len_above_the_scale_lets_it_skip(capsys, ckpt):
    # scale = 5000 e^(0.05) ~ 5256: dense up to 2048 (the config's limit), skips beyond 8192
    code, out = serve(capsys, ckpt(with_curve("prefill", a=5000.0, b=0.1)), "--max-model-len=8192")
    assert code == 0 and "never skips" not in out


def test_disable_skips_validation(capsys, ckpt, monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_DISABLE", "1")
    code, out = serve(capsys, ckpt(with_curve("prefill", a=7.93, b=2000)))
    assert code == 0 and "SPARSE_ATTN_DISABLE=1: the plugin is off" in out


def test_invalid_env_value_is_a_clear_error(capsys, ckpt, monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_STRICT", "maybe")
    code, out = serve(capsys, ckpt(None))
    assert code == 2 and "SPARSE_ATTN_STRICT='maybe' is not a boolean" in out and "Traceback" not in out


@pytest.mark.parametrize("model", ["/no/such/ckpt", "./missing", "a/b/c"], ids=["absolute", "relative", "three_parts"])
def test_missing_path_is_an_error_not_a_hub_id(capsys, model):
    code, out = serve(capsys, model)
    assert code == 2 and "is not a directory (nor a Hugging Face model ID)" in out


def test_file_instead_of_directory_is_an_error(capsys, ckpt):
    code, out = serve(capsys, ckpt(None) / "config.json")
    assert code == 2 and "is not a directory" in out


@pytest.mark.skipif(importlib.util.find_spec("huggingface_hub") is not None,
                    reason="huggingface_hub installed: tests/engine/test_config_sources.py covers the cache lookup")
def test_hub_id_without_huggingface_hub_says_it_validates_nothing(capsys):
    code, out = serve(capsys, "org/model")
    assert code == 0
    assert "huggingface_hub is not installed here" in out and "NOT validated" in out
    assert "--model org/model" in out
