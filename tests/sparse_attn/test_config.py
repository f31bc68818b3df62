"""sparse_attn.config: the sparse_attention_config schema (ModelOpt / TensorRT-LLM)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest

from sparse_attn.config import (
    DEFAULT_TARGET_SPARSITY,
    PhaseFit,
    SparseAttentionConfigError,
    load_from_checkpoint,
    parse_sparse_attention_config,
)

CANONICAL = {
    "config_groups": {
        "group_0": {
            "algorithm": "skip_softmax",
            "targets": ["LlamaAttention"],
            "ignore": ["model.layers.0.self_attn"],
            "threshold_scale_factor": {
                "formula": "a * exp(b * target_sparsity)",
                "prefill": {"a": 7.93, "b": 8.61},
                "decode": {"a": 0.12, "b": 9.85},
            },
            "target_sparsity": {"prefill": 0.5, "decode": 0.3},
        }
    },
    "producer": {"name": "sparse-attn", "version": "0.1.0"},
}


def test_canonical_round_trip_is_identity():
    cfg = parse_sparse_attention_config(CANONICAL)
    assert cfg.to_dict() == CANONICAL
    assert parse_sparse_attention_config(cfg.to_dict()) == cfg
    assert cfg.fits == {"prefill": PhaseFit(7.93, 8.61), "decode": PhaseFit(0.12, 9.85)}
    assert cfg.target_sparsity == {"prefill": 0.5, "decode": 0.3}
    assert cfg.producer.name == "sparse-attn" and cfg.producer.version == "0.1.0"
    assert cfg.missing_phases == () and cfg.warnings == ()


def test_whole_config_json_dict_is_accepted():
    cfg = parse_sparse_attention_config({"model_type": "llama", "sparse_attention_config": CANONICAL})
    assert cfg == parse_sparse_attention_config(CANONICAL)


def test_unknown_keys_are_preserved_verbatim():
    obj = copy.deepcopy(CANONICAL)
    obj["config_groups"]["group_0"]["initial_disabled_steps"] = 5
    obj["calibration_info"] = {"samples": 24}
    out = parse_sparse_attention_config(obj).to_dict()
    assert out["config_groups"]["group_0"]["initial_disabled_steps"] == 5
    assert out["calibration_info"] == {"samples": 24}


def test_legacy_modelopt_layout_is_hoisted_into_the_group():
    legacy = {
        "config_groups": {"group_0": {"sparse_algo": "softmax_skip", "targets": ["LlamaAttention"]}},
        "threshold_scale_factor": {
            "formula": "a * exp(b * target_sparsity)",
            "prefill": {"a": 7.93, "b": 8.61},
            "decode": {"a": 0.12, "b": 9.85},
        },
        "target_sparse_ratio": {"prefill": 0.5, "decode": 0.3},
        "producer": {"name": "modelopt", "version": "0.37.0"},
    }
    cfg = parse_sparse_attention_config(legacy)
    assert cfg.fits["decode"] == PhaseFit(0.12, 9.85)
    assert cfg.target_sparsity == {"prefill": 0.5, "decode": 0.3}
    group = cfg.to_dict()["config_groups"]["group_0"]
    assert group["algorithm"] == "skip_softmax" and "sparse_algo" not in group
    assert group["threshold_scale_factor"]["prefill"] == {"a": 7.93, "b": 8.61}


def test_phase_agnostic_coefficients_apply_to_both_phases():
    cfg = parse_sparse_attention_config(
        {
            "config_groups": {
                "g": {
                    "algorithm": "skip_softmax",
                    "threshold_scale_factor": {"formula": "a*exp(b*target_sparsity)", "coefficients": {"a": 2.0, "b": 3.0}},
                    "target_sparsity": 0.25,
                }
            }
        }
    )
    assert cfg.fits == {"prefill": PhaseFit(2.0, 3.0), "decode": PhaseFit(2.0, 3.0)}
    assert cfg.target_sparsity == {"prefill": 0.25, "decode": 0.25}


def test_log_a_formula_is_converted_and_round_trips():
    obj = {
        "config_groups": {
            "group_0": {
                "algorithm": "skip_softmax",
                "threshold_scale_factor": {"formula": "exp(log_a + b * target_sparsity)", "prefill": {"log_a": math.log(4.0), "b": 2.0}},
            }
        }
    }
    cfg = parse_sparse_attention_config(obj)
    assert cfg.fits["prefill"].a == pytest.approx(4.0)
    assert parse_sparse_attention_config(cfg.to_dict()) == cfg
    assert cfg.to_dict()["config_groups"]["group_0"]["threshold_scale_factor"]["prefill"]["log_a"] == pytest.approx(math.log(4.0))


def test_threshold_is_scale_over_kv_len():
    cfg = parse_sparse_attention_config(CANONICAL)
    expected = 7.93 * math.exp(8.61 * 0.5) / 4096
    assert cfg.threshold("prefill", 4096) == pytest.approx(expected)
    assert cfg.threshold("decode", 1000) == pytest.approx(0.12 * math.exp(9.85 * 0.3) / 1000)
    # a runtime override of the target wins over the checkpoint value
    assert cfg.threshold("prefill", 4096, target_sparsity=0.0) == pytest.approx(7.93 / 4096)
    assert cfg.scale_factor("prefill") == pytest.approx(7.93 * math.exp(8.61 * 0.5))


def test_missing_phase_runs_dense_and_is_reported():
    obj = copy.deepcopy(CANONICAL)
    del obj["config_groups"]["group_0"]["threshold_scale_factor"]["decode"]
    cfg = parse_sparse_attention_config(obj)
    assert cfg.missing_phases == ("decode",)
    assert cfg.threshold("decode", 4096) is None
    assert cfg.threshold("prefill", 4096) is not None
    assert any("no calibrated threshold for the decode phase; it runs dense" in w for w in cfg.warnings)
    assert "decode" not in cfg.to_dict()["config_groups"]["group_0"]["threshold_scale_factor"]


def test_missing_target_defaults_with_a_warning():
    obj = copy.deepcopy(CANONICAL)
    del obj["config_groups"]["group_0"]["target_sparsity"]
    cfg = parse_sparse_attention_config(obj)
    assert cfg.effective_target("prefill") == DEFAULT_TARGET_SPARSITY
    assert cfg.threshold("prefill", 100) == pytest.approx(7.93 * math.exp(8.61 * DEFAULT_TARGET_SPARSITY) / 100)
    assert sum("no target_sparsity" in w for w in cfg.warnings) == 2


@pytest.mark.parametrize("kv_len", [0, -5, None, True], ids=["zero", "negative", "none", "bool"])
def test_threshold_rejects_bad_kv_len(kv_len):
    cfg = parse_sparse_attention_config(CANONICAL)
    with pytest.raises(ValueError, match="kv_len"):
        cfg.threshold("prefill", kv_len)


def test_threshold_rejects_unknown_phase_and_bad_override():
    cfg = parse_sparse_attention_config(CANONICAL)
    with pytest.raises(ValueError, match="phase"):
        cfg.threshold("generate", 100)
    with pytest.raises(SparseAttentionConfigError, match=r"\[0, 1\)"):
        cfg.threshold("prefill", 100, target_sparsity=1.0)


def test_dataclasses_are_frozen():
    cfg = parse_sparse_attention_config(CANONICAL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.group = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.fits["prefill"] = PhaseFit(1, 1)  # type: ignore[index]
    hash(cfg)


def _with(path: list, value):
    obj = copy.deepcopy(CANONICAL)
    node = obj
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return obj


_DELETE = object()
G = ["config_groups", "group_0"]
TSF = G + ["threshold_scale_factor"]

BAD_CASES = [
    ("a_zero", TSF + ["prefill", "a"], 0.0, "threshold_scale_factor.prefill.a", "> 0"),
    ("a_negative", TSF + ["decode", "a"], -1.0, "threshold_scale_factor.decode.a", "> 0"),
    ("a_inf", TSF + ["prefill", "a"], float("inf"), "threshold_scale_factor.prefill.a", "finite"),
    ("b_nan", TSF + ["prefill", "b"], float("nan"), "threshold_scale_factor.prefill.b", "finite"),
    ("a_string", TSF + ["prefill", "a"], "7.9", "threshold_scale_factor.prefill.a", "a number"),
    ("a_missing", TSF + ["prefill", "a"], _DELETE, "threshold_scale_factor.prefill.a", "coefficient 'a'"),
    ("target_one", G + ["target_sparsity", "prefill"], 1.0, "target_sparsity.prefill", "[0, 1)"),
    ("target_negative", G + ["target_sparsity", "decode"], -0.1, "target_sparsity.decode", "[0, 1)"),
    ("target_bad_phase", G + ["target_sparsity", "generate"], 0.5, "target_sparsity.generate", "phases"),
    ("formula_unknown", TSF + ["formula"], "a * b ** target_sparsity", "threshold_scale_factor.formula", "a * exp(b * target_sparsity)"),
    ("formula_missing", TSF + ["formula"], _DELETE, "threshold_scale_factor.formula", "formula string"),
    ("tsf_scalar", TSF, 1000.0, "threshold_scale_factor", "calibration curve"),
    ("tsf_bad_key", TSF + ["prefil"], {"a": 1.0, "b": 1.0}, "threshold_scale_factor.prefil", "phases are named"),
    ("algorithm_unknown", G + ["algorithm"], "rocket", "group_0.algorithm", "'skip_softmax'"),
    ("algorithm_missing", G + ["algorithm"], _DELETE, "group_0.algorithm", "algorithm"),
    ("ignore_not_list", G + ["ignore"], [1, 2], "group_0.ignore", "pattern strings"),
    ("ignore_bad_regex", G + ["ignore"], ["re:(unclosed"], "group_0.ignore", "regular expression"),
    ("groups_empty", ["config_groups"], {}, "config_groups", "non-empty"),
    ("producer_no_name", ["producer"], {"version": "1"}, "producer.name", "non-empty string"),
    ("producer_version_number", ["producer", "version"], 1.0, "producer.version", "version string"),
]


@pytest.mark.parametrize("path,value,key_path,expected", [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_values_name_path_value_expectation_and_fix(path, value, key_path, expected):
    with pytest.raises(SparseAttentionConfigError) as info:
        parse_sparse_attention_config(_with(path, value), source="ckpt/config.json")
    msg = str(info.value)
    assert msg.startswith("sparse_attention_config.") and f".{key_path}" in msg
    assert info.value.path.startswith("sparse_attention_config.") and info.value.path.endswith(key_path)
    assert expected in msg
    assert "Fix:" in msg and "ckpt/config.json" in msg
    assert isinstance(info.value, ValueError)


def test_error_message_has_full_path_value_expectation_and_fix():
    with pytest.raises(SparseAttentionConfigError) as info:
        parse_sparse_attention_config(_with(TSF + ["prefill", "a"], -2.5))
    assert str(info.value) == (
        "sparse_attention_config.config_groups.group_0.threshold_scale_factor.prefill.a: got -2.5; "
        "expected a number > 0. Fix: re-run calibration; a must be positive"
    )


def test_unknown_algorithm_error_lists_supported_ones():
    with pytest.raises(SparseAttentionConfigError) as info:
        parse_sparse_attention_config(_with(G + ["algorithm"], "dsa"))
    msg = str(info.value)
    assert "'dsa'" in msg and "'skip_softmax'" in msg and "'softmax_skip'" in msg


def test_two_skip_softmax_groups_are_rejected():
    obj = copy.deepcopy(CANONICAL)
    obj["config_groups"]["group_1"] = copy.deepcopy(obj["config_groups"]["group_0"])
    with pytest.raises(SparseAttentionConfigError, match="at most one skip_softmax group"):
        parse_sparse_attention_config(obj)


def test_section_must_be_an_object():
    with pytest.raises(SparseAttentionConfigError, match="JSON object"):
        parse_sparse_attention_config(["not", "a", "dict"])  # type: ignore[arg-type]


def _cfg(targets=None, ignore=None):
    group = {"algorithm": "skip_softmax", "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 1, "b": 1}}}
    if targets is not None:
        group["targets"] = targets
    if ignore is not None:
        group["ignore"] = ignore
    return parse_sparse_attention_config({"config_groups": {"group_0": group}})


MATCH_CASES = [
    # id, targets, ignore, layer, classes, expected
    ("no_targets_matches_all", None, None, "model.layers.3.self_attn.attn", "Attention", True),
    ("class_target_hit", ["LlamaAttention"], None, "model.layers.3.self_attn.attn", ["Attention", "LlamaAttention"], True),
    ("class_target_miss", ["LlamaAttention"], None, "model.layers.3.self_attn.attn", "Attention", False),
    ("generic_Attention_target", ["Attention"], None, "model.layers.3.self_attn", "Qwen2Attention", True),
    ("generic_Attention_not_mlp", ["Attention"], None, "model.layers.3.mlp", "LlamaMLP", False),
    ("fnmatch_layer_target", ["*self_attn*"], None, "model.layers.3.self_attn.attn", None, True),
    ("regex_target", ["re:model\\.layers\\.[0-4]\\."], None, "model.layers.3.self_attn.attn", None, True),
    ("regex_target_miss", ["re:model\\.layers\\.[0-2]\\."], None, "model.layers.3.self_attn.attn", None, False),
    ("ignore_hf_parent_module", None, ["model.layers.0.self_attn"], "model.layers.0.self_attn.attn", "Attention", False),
    ("ignore_other_layer", None, ["model.layers.0.self_attn"], "model.layers.10.self_attn.attn", "Attention", True),
    ("ignore_component_relative", None, ["blocks.0.attn1"], "transformer.blocks.0.attn1", None, False),
    ("ignore_wins_over_target", ["LlamaAttention"], ["*layers.1.*"], "model.layers.1.self_attn.attn", "LlamaAttention", False),
    ("ignore_fnmatch_exact_component", None, ["*.layers.1.*"], "model.layers.11.self_attn.attn", None, True),
]


@pytest.mark.parametrize(
    "targets,ignore,layer,classes,expected", [c[1:] for c in MATCH_CASES], ids=[c[0] for c in MATCH_CASES]
)
def test_matches(targets, ignore, layer, classes, expected):
    assert _cfg(targets, ignore).matches(layer, classes) is expected


def test_load_from_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "sparse_attention_config": CANONICAL}))
    cfg = load_from_checkpoint(tmp_path)
    assert cfg == parse_sparse_attention_config(CANONICAL)
    assert cfg.source == str(tmp_path / "config.json")


def test_load_from_checkpoint_without_section_is_none(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert load_from_checkpoint(tmp_path) is None


def test_load_from_checkpoint_errors(tmp_path):
    with pytest.raises(SparseAttentionConfigError, match="config.json"):
        load_from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SparseAttentionConfigError, match="invalid JSON at line 1"):
        load_from_checkpoint(tmp_path)
    bad = copy.deepcopy(CANONICAL)
    bad["config_groups"]["group_0"]["threshold_scale_factor"]["prefill"]["a"] = -1
    (tmp_path / "config.json").write_text(json.dumps({"sparse_attention_config": bad}))
    with pytest.raises(SparseAttentionConfigError, match=r"threshold_scale_factor\.prefill\.a in .*config\.json"):
        load_from_checkpoint(tmp_path)
