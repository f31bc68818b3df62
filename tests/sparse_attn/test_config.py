"""sparse_attn.config: the sparse_attention_config schema (ModelOpt / TensorRT-LLM)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time

import pytest

from sparse_attn.config import (
    DEFAULT_TARGET_SPARSITY,
    LN_SCALE_BOUND,
    PhaseFit,
    SparseAttentionConfigError,
    UnservedGroup,
    config_value,
    is_modelopt_section,
    load_from_checkpoint,
    parse_sparse_attention_config,
    read_section,
    text_model_config,
)
from sparse_attn.kernels import effective_lambda, never_skips

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


@pytest.mark.parametrize("kv_len, window", [(100, None), (587, None), (588, None), (4096, 40), (30, 40),
                                            (4096, 512)],
                         ids=["kv100", "kv587", "kv588", "window40", "kv30-window40", "window512"])
def test_threshold_is_the_lambda_serving_uses(kv_len, window):
    """cfg.threshold is kernels.effective_lambda of the phase's scale factor, dense rule included:
    0.0 where scale / normaliser >= 1 (the prefill scale is 7.93 exp(8.61 / 2) = 587.4)."""
    cfg = parse_sparse_attention_config(_with_window_curve())
    windowed = window is not None
    scale = cfg.scale_factor("prefill", windowed=windowed)
    norm = min(kv_len, window) if windowed else kv_len
    expected = scale / norm if scale / norm < 1 else 0.0
    assert cfg.threshold("prefill", kv_len, window=window) == pytest.approx(expected)
    assert cfg.threshold("prefill", kv_len, window=window) == effective_lambda(scale, kv_len, window)
    assert (expected == 0.0) == never_skips(scale, norm)


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
    assert cfg.threshold("prefill", 4096) == pytest.approx(7.93 * math.exp(8.61 * DEFAULT_TARGET_SPARSITY) / 4096)
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
    with pytest.raises(SparseAttentionConfigError, match=r"config\.json: is not valid JSON \(line 1"):
        load_from_checkpoint(tmp_path)
    bad = copy.deepcopy(CANONICAL)
    bad["config_groups"]["group_0"]["threshold_scale_factor"]["prefill"]["a"] = -1
    (tmp_path / "config.json").write_text(json.dumps({"sparse_attention_config": bad}))
    with pytest.raises(SparseAttentionConfigError, match=r"threshold_scale_factor\.prefill\.a in .*config\.json"):
        load_from_checkpoint(tmp_path)


# --------------------------------------------------------------------------- #
# whose section is it (issue 9 item 1)
# --------------------------------------------------------------------------- #
MINIMAX = {"use_sparse_attention": True, "sparse_index_dim": 128, "sparse_topk_blocks": 16, "sparse_block_size": 128}
NM_GROUP = {"algorithm": "sparse_softmax", "sparsity_n": 2, "sparsity_m": 4, "dense_sink_tokens": 0, "dense_recent_tokens": 64}

FOREIGN_CASES = [
    ("minimax_m3", MINIMAX),
    ("list", [1, 2]),
    ("string", "enabled"),
    ("number", 16),
    ("bool", True),
    ("empty_object", {}),
    ("compressed_tensors_like_groups", {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4}}}}),
]
# ModelOpt metadata of the wrong shape (issue 19): still native, but a warning that says so, not "the model's own".
WRONG_SHAPE_CASES = [
    ("config_groups_empty", {"config_groups": {}}, "config_groups is an empty object"),
    ("config_groups_not_object", {"config_groups": ["group_0"]}, "config_groups is a JSON list"),
    ("groups_are_not_objects", {"config_groups": {"group_0": "skip_softmax"}}, "group group_0 is a JSON str"),
    ("misspelt_config_groups", {"config_group": {"group_0": {"algorithm": "skip_softmax"}}}, "did you mean 'config_groups'"),
]


@pytest.mark.parametrize("section,seen", [c[1:] for c in WRONG_SHAPE_CASES], ids=[c[0] for c in WRONG_SHAPE_CASES])
def test_modelopt_metadata_of_the_wrong_shape_is_named_as_such(section, seen):
    reading = read_section(section, source="ckpt/config.json")
    assert reading.config is None and not reading.ours and reading.present and reading.malformed
    assert seen in reading.note and "looks like ModelOpt / TensorRT-LLM metadata of the wrong shape" in reading.note
    assert "belongs to the model itself" not in reading.note and "leaves vLLM attention native" in reading.note


@pytest.mark.parametrize("section", [c[1] for c in FOREIGN_CASES], ids=[c[0] for c in FOREIGN_CASES])
def test_sections_of_another_shape_are_not_ours_and_never_raise(section):
    assert not is_modelopt_section(section)
    reading = read_section(section, source="ckpt/config.json")
    assert reading.config is None and not reading.ours and reading.present and not reading.malformed
    assert "not ModelOpt / TensorRT-LLM skip-softmax metadata" in reading.note
    assert "leaves vLLM attention native" in reading.note


def test_foreign_note_names_the_keys_it_saw():
    note = read_section(MINIMAX).note
    assert "sparse_topk_blocks" in note and "use_sparse_attention" in note


def test_absent_section_is_neither_ours_nor_present():
    reading = read_section(None)
    assert reading.config is None and not reading.ours and not reading.present


OURS_CASES = [
    ("current_layout", CANONICAL, "group_0"),
    ("legacy_sparse_algo", {"config_groups": {"g": {"sparse_algo": "softmax_skip"}},
                            "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 1, "b": 1}}}, "g"),
    ("skip_group_second", {"config_groups": {"group_0": NM_GROUP, "group_1": CANONICAL["config_groups"]["group_0"]}}, "group_1"),
]


@pytest.mark.parametrize("section,served", [c[1:] for c in OURS_CASES], ids=[c[0] for c in OURS_CASES])
def test_modelopt_shaped_sections_are_ours(section, served):
    assert is_modelopt_section(section)
    reading = read_section(section)
    assert reading.ours and reading.config is not None and reading.config.group.name == served


def test_modelopt_metadata_without_a_skip_softmax_group_serves_nothing_and_lists_groups():
    reading = read_section({"config_groups": {"group_1": NM_GROUP}})
    assert reading.ours and reading.config is None
    assert reading.unserved == (UnservedGroup("group_1", "sparse_softmax"),)
    assert "no skip_softmax group" in reading.note and "group_1 ('sparse_softmax')" in reading.note
    # the export check still insists on a skip-softmax group
    with pytest.raises(SparseAttentionConfigError, match=r"group_1\.algorithm.*'sparse_softmax'"):
        parse_sparse_attention_config({"config_groups": {"group_1": NM_GROUP}})


# --------------------------------------------------------------------------- #
# several groups (item 2)
# --------------------------------------------------------------------------- #
def _two_groups(skip_first: bool = True) -> dict:
    obj = copy.deepcopy(CANONICAL)
    skip = obj["config_groups"]["group_0"]
    skip["initial_disabled_steps"] = 3
    groups = {"group_0": skip, "group_1": copy.deepcopy(NM_GROUP)}
    if not skip_first:
        groups = {"group_1": copy.deepcopy(NM_GROUP), "group_0": skip}
    obj["config_groups"] = groups
    obj["producer"] = {"name": "modelopt", "version": "0.47.0"}
    return obj


@pytest.mark.parametrize("skip_first", [True, False], ids=["skip_group_first", "nm_group_first"])
def test_two_group_modelopt_export_serves_skip_softmax_and_round_trips_verbatim(skip_first):
    obj = _two_groups(skip_first)
    cfg = parse_sparse_attention_config(obj)
    assert cfg.group.name == "group_0" and cfg.fits["prefill"] == PhaseFit(7.93, 8.61)
    assert cfg.unserved_groups == (UnservedGroup("group_1", "sparse_softmax"),)
    out = cfg.to_dict()
    assert out == obj
    assert list(out["config_groups"]) == list(obj["config_groups"])  # file order kept
    assert json.dumps(out) == json.dumps(obj)
    assert parse_sparse_attention_config(out) == cfg


def test_unserved_group_is_a_warning_naming_its_algorithm():
    cfg = parse_sparse_attention_config(_two_groups())
    notes = [w for w in cfg.warnings if "group_1" in w]
    assert notes == [
        "sparse_attention_config.config_groups.group_1 (algorithm 'sparse_softmax') is not served: this runtime "
        "implements only skip_softmax, so this group's sparsity is not applied (set SPARSE_ATTN_STRICT=1 to make "
        "this an error)"
    ]


def test_group_without_algorithm_beside_skip_group_is_reported_not_fatal():
    obj = _two_groups()
    obj["config_groups"]["group_2"] = {"targets": ["MLP"]}
    reading = read_section(obj)
    assert reading.config is not None
    assert UnservedGroup("group_2", None) in reading.unserved
    assert any("group_2 (no algorithm key) is not served" in w for w in reading.config.warnings)


def test_unserved_groups_are_not_copied_by_reference():
    obj = _two_groups()
    cfg = parse_sparse_attention_config(obj)
    obj["config_groups"]["group_1"]["sparsity_n"] = 99
    assert cfg.to_dict()["config_groups"]["group_1"]["sparsity_n"] == 2


@pytest.mark.parametrize("path,value,key_path", [
    (["config_groups", "group_0", "threshold_scale_factor", "decode", "a"], -3, "group_0.threshold_scale_factor.decode.a"),
    (["config_groups", "group_0", "target_sparsity", "prefill"], 1.5, "group_0.target_sparsity.prefill"),
    (["config_groups", "group_0", "ignore"], ["re:(unclosed"], "group_0.ignore"),
], ids=["negative_a", "target_above_one", "bad_regex"])
def test_malformed_skip_group_beside_nm_group_still_fails_with_key_path(path, value, key_path):
    obj = _two_groups()
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(SparseAttentionConfigError) as info:
        read_section(obj, source="ckpt/config.json")
    assert info.value.path == f"sparse_attention_config.config_groups.{key_path}"


# --------------------------------------------------------------------------- #
# curves that would do harm (item 5)
# --------------------------------------------------------------------------- #
def _curve(coefs: dict, formula: str = "a * exp(b * target_sparsity)") -> dict:
    return {"config_groups": {"group_0": {"algorithm": "skip_softmax",
                                          "threshold_scale_factor": {"formula": formula, "prefill": coefs},
                                          "target_sparsity": {"prefill": 0.5}}}}


LOG_FORMULA = "exp(log_a + b * target_sparsity)"
HARMFUL_CURVES = [
    # id, coefficients, formula, blamed key
    ("b_2000", {"a": 7.9, "b": 2000}, None, "b"),
    ("b_minus_2000", {"a": 7.9, "b": -2000}, None, "b"),
    ("b_huge_integer", {"a": 7.9, "b": 10 ** 400}, None, "b"),
    ("a_huge_integer", {"a": 10 ** 400, "b": 1.0}, None, "a"),
    ("a_1e300_times_exp_b", {"a": 1e300, "b": 20.0}, None, "a"),
    ("a_subnormal", {"a": 1e-310, "b": 1.0}, None, "a"),
    ("log_a_710", {"log_a": 710.0, "b": 1.0}, LOG_FORMULA, "log_a"),
    ("log_a_minus_710", {"log_a": -710.0, "b": 1.0}, LOG_FORMULA, "log_a"),
    ("log_a_huge_integer", {"log_a": 10 ** 400, "b": 1.0}, LOG_FORMULA, "log_a"),
]


@pytest.mark.parametrize("coefs,formula,key", [c[1:] for c in HARMFUL_CURVES], ids=[c[0] for c in HARMFUL_CURVES])
def test_curves_without_a_finite_scale_at_every_target_fail_at_parse_with_key_path(coefs, formula, key):
    with pytest.raises(SparseAttentionConfigError) as info:  # never OverflowError / a raw traceback
        parse_sparse_attention_config(_curve(coefs, formula or "a * exp(b * target_sparsity)"), source="ckpt/config.json")
    assert info.value.path == f"sparse_attention_config.config_groups.group_0.threshold_scale_factor.prefill.{key}"
    assert "Fix:" in str(info.value) and "ckpt/config.json" in str(info.value)


@pytest.mark.parametrize("coefs,formula", [
    ({"a": 1.0, "b": 699.0}, None),
    ({"a": 1.0, "b": -699.0}, None),
    ({"log_a": 690.0, "b": 9.0}, LOG_FORMULA),
    ({"a": 1e-300, "b": 5.0}, None),
], ids=["b_699", "b_minus_699", "log_a_690_plus_b_9", "a_1e-300"])
def test_curves_at_the_edge_of_the_bound_give_a_finite_positive_scale_at_every_target(coefs, formula):
    cfg = parse_sparse_attention_config(_curve(coefs, formula or "a * exp(b * target_sparsity)"))
    ln_a = coefs.get("log_a", None)
    ln_a = math.log(coefs["a"]) if ln_a is None else ln_a
    for target in (0.0, 0.5, 0.999999):
        scale = cfg.scale_factor("prefill", target)
        assert math.isfinite(scale) and scale > 0
        # independent reference: evaluated in log space
        assert math.log(scale) == pytest.approx(ln_a + coefs["b"] * target, rel=1e-9, abs=1e-9)
        assert abs(math.log(scale)) <= LN_SCALE_BOUND


# --------------------------------------------------------------------------- #
# re: patterns must match in bounded time (item 5)
# --------------------------------------------------------------------------- #
REGEX_HAZARDS = [
    ("issue_pattern", "re:([a-z._0-9]+)*X", "nested quantifiers"),
    ("plus_plus", "re:(a+)+b", "nested quantifiers"),
    ("star_in_counted", "re:(?:model\\.[0-9]*){2,}", "nested quantifiers"),
    ("alternation_in_star", "re:(?:self_attn|attn)*x", "alternation"),
    ("backreference", "re:(model)\\.\\1", "back-references"),
    ("four_unbounded", "re:.*a.*b.*c.*d", "at most 3 unbounded repeats"),
    ("too_long", "re:" + "a" * 300, "at most 256 characters"),
]


@pytest.mark.parametrize("where", ["targets", "ignore"])
@pytest.mark.parametrize("pattern,why", [c[1:] for c in REGEX_HAZARDS], ids=[c[0] for c in REGEX_HAZARDS])
def test_backtracking_regexes_are_rejected_at_parse_time(where, pattern, why):
    t0 = time.perf_counter()
    with pytest.raises(SparseAttentionConfigError) as info:
        _cfg(**{where: [pattern]})
    assert time.perf_counter() - t0 < 0.5
    assert info.value.path == f"sparse_attention_config.config_groups.group_0.{where}"
    assert why in str(info.value) and repr(pattern)[:40] in str(info.value)


def test_issue_pattern_is_rejected_before_any_layer_is_matched():
    # re:([a-z._0-9]+)*X took 18 s per 29-character layer name; now it never reaches a match.
    with pytest.raises(SparseAttentionConfigError, match="nested quantifiers"):
        _cfg(targets=["re:([a-z._0-9]+)*X"])


SAFE_REGEXES = [
    ("layer_range", "re:model\\.layers\\.[0-9]+\\.self_attn", "model.layers.3.self_attn.attn", True),
    ("alternation_outside_repeat", "re:.*layers\\.(1|2)\\..*", "model.layers.2.self_attn.attn", True),
    ("optional_group", "re:(model\\.)?layers\\.0\\.", "layers.0.self_attn", True),
    ("three_unbounded", "re:.*\\.[0-9]+\\..*attn", "model.layers.7.self_attn.attn", True),
    ("rewritten_issue_pattern", "re:[a-z._0-9]*X", "model.layers.10.self_attn.att", False),
]


@pytest.mark.parametrize("pattern,layer,expected", [c[1:] for c in SAFE_REGEXES], ids=[c[0] for c in SAFE_REGEXES])
def test_accepted_regexes_match_and_stay_fast_on_long_near_miss_names(pattern, layer, expected):
    cfg = _cfg(targets=[pattern])
    assert cfg.matches(layer, None) is expected
    near_miss = "model.layers.1234567890." + "a" * 300 + ".self_att"
    t0 = time.perf_counter()
    for _ in range(10):
        cfg.matches(near_miss, ["LlamaAttention", "Attention"])
    assert time.perf_counter() - t0 < 1.0


# --------------------------------------------------------------------------- #
# configs that can never skip warn (item 5)
# --------------------------------------------------------------------------- #
NEVER_SKIP = [
    # id, prefill (a, b), prefill target, max_kv_len, warns
    ("a_1e6", (1e6, 4.0), 0.5, 2048, True),
    ("target_0.99999", (7.93, 8.61), 0.99999, 2048, True),
    ("calibrated_curve", (7.93, 8.61), 0.5, 2048, False),
    ("long_context_makes_it_skip", (7.93, 8.61), 0.99999, 131072, False),
    ("unknown_max_len", (1e6, 4.0), 0.5, None, False),
]


@pytest.mark.parametrize("ab,target,max_kv_len,warns", [c[1:] for c in NEVER_SKIP], ids=[c[0] for c in NEVER_SKIP])
def test_never_skip_warning_when_lambda_stays_at_or_above_one(ab, target, max_kv_len, warns):
    section = _curve({"a": ab[0], "b": ab[1]})
    section["config_groups"]["group_0"]["target_sparsity"]["prefill"] = target
    cfg = parse_sparse_attention_config(section)
    notes = cfg.never_skip_warnings(max_kv_len)
    # independent reference: lambda = a e^(b t) / kv_len >= 1 at the longest kv_len
    expected = max_kv_len is not None and ab[0] * math.exp(ab[1] * target) / max_kv_len >= 1
    assert expected is warns
    assert bool(notes) is warns
    assert cfg.never_skipping_phases(max_kv_len) == (("prefill",) if warns else ())
    if warns:
        assert len(notes) == 1 and "prefill phase never skips a tile" in notes[0]
        assert f"up to {max_kv_len} tokens" in notes[0] and "threshold_scale_factor.prefill" in notes[0]


@pytest.mark.parametrize("b", [-3.0, 0.0], ids=["negative_b", "zero_b"])
def test_curve_that_does_not_grow_with_the_target_warns(b):
    cfg = parse_sparse_attention_config(_curve({"a": 20.0, "b": b}))
    notes = [w for w in cfg.warnings if ".b is" in w]
    assert len(notes) == 1
    assert notes[0].startswith(f"sparse_attention_config.config_groups.group_0.threshold_scale_factor.prefill.b is {b!r}")


# --------------------------------------------------------------------------- #
# Qwen dual-chunk's sparse_attention_config.json is never read or written
# --------------------------------------------------------------------------- #
def test_checkpoint_loading_never_touches_qwen_dual_chunk_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "sparse_attention_config": CANONICAL}))
    qwen = tmp_path / "sparse_attention_config.json"
    qwen.write_text("{not json: Qwen dual-chunk's own file")
    before = qwen.stat()
    assert load_from_checkpoint(tmp_path) == parse_sparse_attention_config(CANONICAL)
    after = qwen.stat()
    assert qwen.read_text() == "{not json: Qwen dual-chunk's own file"
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)


# --------------------------------------------------------------------------- the sliding-window curve
def _with_window_curve(curve=None) -> dict:
    obj = copy.deepcopy(CANONICAL)
    obj["config_groups"]["group_0"]["sliding_window_threshold_scale_factor"] = curve if curve is not None else {
        "formula": "a * exp(b * target_sparsity)",
        "prefill": {"a": 2.5, "b": 6.0},
        "decode": {"a": 0.4, "b": 7.0},
    }
    return obj


def test_window_curve_round_trips_and_serves_windowed_layers_over_min_of_kv_len_and_window():
    obj = _with_window_curve()
    cfg = parse_sparse_attention_config(obj)
    assert cfg.to_dict() == obj and parse_sparse_attention_config(cfg.to_dict()) == cfg
    assert cfg.has_window_curve and cfg.warnings == ()
    assert cfg.group.window_fits == {"prefill": PhaseFit(2.5, 6.0), "decode": PhaseFit(0.4, 7.0)}
    # global layers: the main curve over kv_len (unchanged); windowed: their own curve over min(kv_len, w)
    assert cfg.threshold("prefill", 4096) == pytest.approx(7.93 * math.exp(8.61 * 0.5) / 4096)
    assert cfg.threshold("prefill", 4096, window=512) == pytest.approx(2.5 * math.exp(6.0 * 0.5) / 512)
    assert cfg.threshold("decode", 300, window=512) == pytest.approx(0.4 * math.exp(7.0 * 0.3) / 300)
    assert cfg.scale_factor("decode", windowed=True) == pytest.approx(0.4 * math.exp(7.0 * 0.3))


def test_without_the_window_curve_windowed_layers_keep_the_main_curve_over_kv_len():
    """Checkpoints calibrated before the window curve (and ModelOpt's) mean what they meant: TensorRT-LLM's rule."""
    cfg = parse_sparse_attention_config(CANONICAL)
    assert not cfg.has_window_curve
    assert cfg.threshold("prefill", 4096, window=512) == pytest.approx(7.93 * math.exp(8.61 * 0.5) / 4096)
    assert cfg.scale_factor("prefill", windowed=True) == cfg.scale_factor("prefill")


def test_window_curve_without_a_phase_runs_that_phase_dense_on_windowed_layers_and_says_so():
    cfg = parse_sparse_attention_config(_with_window_curve({"formula": "a * exp(b * target_sparsity)",
                                                            "prefill": {"a": 2.5, "b": 6.0}}))
    assert cfg.threshold("decode", 4096, window=512) is None
    assert cfg.threshold("decode", 4096) is not None
    assert [w for w in cfg.warnings if "sliding_window_threshold_scale_factor has no decode curve" in w]


@pytest.mark.parametrize("curve, where, expected", [
    ({"formula": "a * exp(b * target_sparsity)", "prefill": {"a": -1.0, "b": 6.0}}, ".prefill.a", "a number > 0"),
    ({"formula": "a * exp(b * target_sparsity)", "prefil": {"a": 1.0, "b": 6.0}}, ".prefil", "only formula"),
    ({"formula": "a * b"}, ".formula", "one of"),
    (3.0, "", "a calibration curve"),
], ids=["negative-a", "misspelt-phase", "unknown-formula", "a-number"])
def test_a_malformed_window_curve_is_refused_with_its_path(curve, where, expected):
    with pytest.raises(SparseAttentionConfigError, match=expected) as info:
        parse_sparse_attention_config(_with_window_curve(curve))
    path = "sparse_attention_config.config_groups.group_0.sliding_window_threshold_scale_factor" + where
    assert str(info.value).startswith(path + ":")


def test_never_skip_warning_names_the_window_curve():
    cfg = parse_sparse_attention_config(_with_window_curve({"formula": "a * exp(b * target_sparsity)",
                                                            "prefill": {"a": 5000.0, "b": 1.0}}))
    notes = cfg.never_skip_warnings(2048)
    assert len(notes) == 1 and "sliding_window_threshold_scale_factor.prefill" in notes[0]
    assert "min(kv_len, window)" in notes[0] and "of the sliding-window layers never skips" in notes[0]
    assert cfg.never_skipping_phases(2048) == ()  # the main curve still skips


# --------------------------------------------------------------------------- the model's own config.json fields

GEMMA3_MULTIMODAL = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                     "text_config": {"vocab_size": 262208, "head_dim": 256, "max_position_embeddings": 131072},
                     "vision_config": {"hidden_size": 1152}}
GEMMA3_TEXT = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "head_dim": 256,
               "max_position_embeddings": 32768}


@pytest.mark.parametrize("cfg, vocab, head, limit", [
    (GEMMA3_MULTIMODAL, 262208, 256, 131072),
    (GEMMA3_TEXT, 262144, 256, 32768),
    ({"vocab_size": 49152, "text_config": {"vocab_size": 7, "head_dim": 64}}, 49152, 64, None),
    ({"text_config": {}}, None, None, None),
], ids=["nested-text-config", "flat", "top-level-wins", "empty"])
def test_model_fields_come_from_the_top_level_else_text_config(cfg, vocab, head, limit):
    assert config_value(cfg, "vocab_size") == vocab
    assert config_value(cfg, "max_position_embeddings") == limit
    assert text_model_config(cfg).get("head_dim") == head
