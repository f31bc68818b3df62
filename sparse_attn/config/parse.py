"""Parsing a ``sparse_attention_config`` value: whose section it is
(:func:`is_modelopt_section`, :func:`read_section`) and the strict export check
(:func:`parse_sparse_attention_config`)."""

from __future__ import annotations

import copy
import difflib
import math
from dataclasses import dataclass
from typing import Any, Mapping

from sparse_attn import jsonio
from sparse_attn.protocol import PHASES

from .errors import MISSING, SparseAttentionConfigError, short_repr, short_text
from .schema import (
    DEFAULT_FORMULA,
    GROUP_KNOWN_KEYS,
    LN_SCALE_BOUND,
    SECTION_KEY,
    SECTION_KNOWN_KEYS,
    SUPPORTED_ALGORITHMS,
    SUPPORTED_FORMULAS,
    PhaseFit,
    Producer,
    SkipSoftmaxGroup,
    SparseAttentionConfig,
    UnservedGroup,
    WINDOW_CURVE_KEY,
    algorithm_key,
    check_target,
    group_algorithm,
    is_number,
    normalise_formula,
    number,
)
from .targeting import pattern_list

__all__ = ["SectionReading", "is_modelopt_section", "parse_sparse_attention_config", "read_section"]


def _require_mapping(value: Any, path: str, source: str | None, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SparseAttentionConfigError(path, value, f"a JSON object ({what})", f"make {path} an object", source=source)
    return value


def _is_skip_softmax(group: Any) -> bool:
    raw = group_algorithm(group)
    return isinstance(raw, str) and any(raw in spellings for spellings in SUPPORTED_ALGORITHMS.values())


def _unsupported_algorithm_error(name: str, group: Any, root: str, source: str | None) -> SparseAttentionConfigError:
    gpath = f"{root}.config_groups.{name}"
    key = algorithm_key(group)
    if key is None:
        return SparseAttentionConfigError(
            f"{gpath}.algorithm", MISSING, 'an "algorithm" key', 'add "algorithm": "skip_softmax"', source=source
        )
    supported = ", ".join(repr(s) for spellings in SUPPORTED_ALGORITHMS.values() for s in spellings)
    return SparseAttentionConfigError(
        f"{gpath}.{key}", group[key], f"a supported algorithm ({supported})",
        "this runtime only implements skip-softmax; add a skip_softmax group (run `sparse-attn calibrate`) "
        "or serve the checkpoint with a runtime that supports this algorithm", source=source,
    )


def _parse_targets(value: Any, path: str, source: str | None) -> dict[str, float]:
    if value is None:
        return {}
    if is_number(value):
        t = check_target(value, path, "set target_sparsity to a value in [0, 1), e.g. 0.5", source)
        return {p: t for p in PHASES}
    mapping = _require_mapping(value, path, source, "a number or {prefill, decode}")
    out: dict[str, float] = {}
    for key, v in mapping.items():
        if key not in PHASES:
            raise SparseAttentionConfigError(
                f"{path}.{key}", v, f"only the phases {list(PHASES)}", f"rename or remove {key!r}", source=source
            )
        if v is None:
            continue
        out[key] = check_target(v, f"{path}.{key}", "set target_sparsity to a value in [0, 1), e.g. 0.5", source)
    return out


def _parse_coefficients(coefs: Any, names: tuple[str, str], path: str, source: str | None) -> PhaseFit:
    mapping = _require_mapping(coefs, path, source, f"coefficients {list(names)}")
    values = {}
    for name in names:
        if name not in mapping:
            raise SparseAttentionConfigError(
                f"{path}.{name}", MISSING, f"coefficient {name!r} (the formula uses {list(names)})",
                "re-run calibration or add the coefficient", source=source,
            )
        values[name] = number(mapping[name], f"{path}.{name}", source, positive=(name == "a"))
    ln_a = values["log_a"] if names[0] == "log_a" else math.log(values["a"])
    b = values["b"]
    # ln(scale) = ln a + b * t is linear in t, so its extremes over t in [0, 1] are at the ends.
    ln_hi, ln_lo = ln_a + max(b, 0.0), ln_a + min(b, 0.0)
    if ln_hi > LN_SCALE_BOUND or ln_lo < -LN_SCALE_BOUND:
        culprit = "b" if abs(b) >= abs(ln_a) else names[0]
        raise SparseAttentionConfigError(
            f"{path}.{culprit}", values[culprit],
            f"a curve whose scale factor a * exp(b * t) stays a finite, non-zero number for every target t in "
            f"[0, 1], i.e. ln(a) + b * t within +-{LN_SCALE_BOUND:g} (here ln(a) = {ln_a:.6g}, b = {b:.6g}: "
            f"ln(scale) spans [{ln_lo:.6g}, {ln_hi:.6g}])",
            "re-run `sparse-attn calibrate`; calibrated curves have ln(a) and b of order 1-20", source=source,
        )
    return PhaseFit(a=math.exp(ln_a) if names[0] == "log_a" else values["a"], b=b)


def _parse_scale_factor(value: Any, path: str, source: str | None) -> tuple[str, dict[str, PhaseFit]]:
    if value is None:
        return DEFAULT_FORMULA, {}
    if is_number(value):
        raise SparseAttentionConfigError(
            path, value, "a calibration curve {formula, prefill: {a, b}, decode: {a, b}}",
            "a single number is not a calibration; run `sparse-attn calibrate CKPT --update_checkpoint_config` "
            "to write the curve, or write {formula, prefill: {a, b}, decode: {a, b}} yourself", source=source,
        )
    mapping = _require_mapping(value, path, source, "formula and per-phase coefficients")
    formula = mapping.get("formula", MISSING)
    if not isinstance(formula, str):
        raise SparseAttentionConfigError(
            f"{path}.formula", formula, f"a formula string, one of {list(SUPPORTED_FORMULAS)}",
            f'add "formula": "{DEFAULT_FORMULA}"', source=source,
        )
    try:
        formula_key = normalise_formula(formula)
    except KeyError:
        raise SparseAttentionConfigError(
            f"{path}.formula", formula, f"one of {list(SUPPORTED_FORMULAS)}",
            "re-export the calibration with the exponential formula", source=source,
        ) from None
    names = SUPPORTED_FORMULAS[formula_key]
    fits: dict[str, PhaseFit] = {}
    if "coefficients" in mapping:
        if any(p in mapping for p in PHASES):
            raise SparseAttentionConfigError(
                f"{path}.coefficients", mapping["coefficients"], "either 'coefficients' or per-phase entries, not both",
                "remove one of them", source=source,
            )
        fit = _parse_coefficients(mapping["coefficients"], names, f"{path}.coefficients", source)
        fits = {p: fit for p in PHASES}
    for phase in PHASES:
        if phase in mapping and mapping[phase] is not None:
            fits[phase] = _parse_coefficients(mapping[phase], names, f"{path}.{phase}", source)
    unknown = [k for k in mapping if k not in ("formula", "coefficients", *PHASES)]
    if unknown:
        raise SparseAttentionConfigError(
            f"{path}.{unknown[0]}", mapping[unknown[0]], f"only formula, coefficients, {', '.join(PHASES)}",
            f"remove {unknown[0]!r} (phases are named {list(PHASES)})", source=source,
        )
    return formula, fits


def is_modelopt_section(section: Any) -> bool:
    """Whether ``section`` has the shape of ModelOpt / TensorRT-LLM sparse-attention metadata:
    ``config_groups`` with at least one group carrying ``algorithm`` or ``sparse_algo``.

    Other users of the key (MiniMax-M3's ``{"use_sparse_attention": true, ...}``) are not ours.
    """
    if not isinstance(section, Mapping):
        return False
    groups = section.get("config_groups")
    return isinstance(groups, Mapping) and any(algorithm_key(g) is not None for g in groups.values())


@dataclass(frozen=True)
class SectionReading:
    """What a checkpoint's ``sparse_attention_config`` value means for this runtime.

    ``config`` is the skip-softmax group to serve, or None (native attention);
    ``note`` then says why in one line. ``ours`` is False for an absent or a
    foreign section (another model's use of the key). ``unserved`` lists the
    ModelOpt groups we do not serve.
    """

    config: SparseAttentionConfig | None
    ours: bool
    note: str | None = None
    unserved: tuple[UnservedGroup, ...] = ()
    #: False when the key is absent altogether
    present: bool = True
    #: True when the section looks like ModelOpt metadata of the wrong shape (``config_groups``
    #: a list, empty, without algorithms, or misspelt): ``note`` is then a warning, not info
    malformed: bool = False


def _foreign_note(section: Any) -> str:
    if isinstance(section, Mapping):
        keys = ", ".join(short_text(k, 40) for k in sorted(map(str, section))[:6])
        shape = f"an object with keys {keys}" if keys else "an empty object"
    else:
        shape = f"a {type(section).__name__}"
    return (
        f"{SECTION_KEY} is {shape}, not ModelOpt / TensorRT-LLM skip-softmax metadata (config_groups whose "
        f"groups carry an algorithm); it belongs to the model itself, so sparse-attn leaves vLLM attention native"
    )


_WRONG_SHAPE_FIX = (
    'expected config_groups to be an object of groups, each with an "algorithm", e.g. '
    '{"group_0": {"algorithm": "skip_softmax", "threshold_scale_factor": {...}}}; sparse-attn leaves vLLM attention '
    "native. Fix: repair the section or re-export it with `sparse-attn calibrate CKPT --update_checkpoint_config`"
)


def _wrong_shape_note(section: Any) -> str | None:
    """Why ``section`` (not ModelOpt-shaped) still looks like ModelOpt metadata, or None."""
    if not isinstance(section, Mapping):
        return None
    if "config_groups" in section:
        groups = section["config_groups"]
        if not isinstance(groups, Mapping):
            seen = f"a JSON {type(groups).__name__}"
        elif not groups:
            seen = "an empty object"
        elif any(not isinstance(g, Mapping) for g in groups.values()):
            name, group = next((k, g) for k, g in groups.items() if not isinstance(g, Mapping))
            seen = f"an object whose group {short_text(name, 40)} is a JSON {type(group).__name__}, not an object"
        else:  # objects without an algorithm: another schema's groups (compressed-tensors), not ours
            return None
        return f"{SECTION_KEY}.config_groups is {seen}: this looks like ModelOpt / TensorRT-LLM metadata of the wrong shape ({_WRONG_SHAPE_FIX})"
    for key in section:
        if isinstance(key, str) and len(key) <= 64 and difflib.get_close_matches(key.lower(), ["config_groups"], n=1, cutoff=0.8):
            return (f"{SECTION_KEY} has no config_groups but has {key!r}; did you mean 'config_groups'? This looks like "
                    f"ModelOpt / TensorRT-LLM metadata of the wrong shape ({_WRONG_SHAPE_FIX})")
    return None


def _check_depth(section: Mapping[str, Any], source: str | None) -> None:
    # Unknown keys are kept verbatim (deep-copied into the parsed config and back out in
    # to_dict); a value nested hundreds deep would exhaust the stack there.
    deep = jsonio.depth_exceeded(section, jsonio.MAX_DEPTH)
    if deep is not None:
        raise SparseAttentionConfigError(
            f"{SECTION_KEY}.{deep}", "a value nested deeper than that", f"at most {jsonio.MAX_DEPTH} levels of nesting",
            "remove or flatten the deeply nested value (sparse-attn reads only the keys documented in sparse_attn.config)",
            source=source,
        )


def read_section(section: Any, *, source: str | None = None) -> SectionReading:
    """Classify and parse a ``sparse_attention_config`` value (None when the key is absent).

    Never raises for a section that is not ours (absent, or foreign-shaped);
    raises :class:`SparseAttentionConfigError` with the key path only for
    ModelOpt-shaped metadata whose skip-softmax group is malformed (or that has
    two skip-softmax groups, which TensorRT-LLM rejects too).
    """
    if section is None:
        return SectionReading(None, ours=False, note=f"no {SECTION_KEY}", present=False)
    if not is_modelopt_section(section):
        wrong = _wrong_shape_note(section)
        if wrong is not None:
            return SectionReading(None, ours=False, note=wrong, malformed=True)
        return SectionReading(None, ours=False, note=_foreign_note(section))
    _check_depth(section, source)
    config, unserved = _parse_section(section, source)
    if config is None:
        listed = ", ".join(f"{short_text(g.name, 60)} ({short_repr(g.algorithm, 60)})" if g.algorithm is not None
                           else f"{short_text(g.name, 60)} (no algorithm)" for g in unserved[:8])
        note = f"{SECTION_KEY} has no skip_softmax group (groups: {listed}); vLLM attention left native"
        return SectionReading(None, ours=True, note=note, unserved=unserved)
    return SectionReading(config, ours=True, unserved=unserved)


def parse_sparse_attention_config(obj: Mapping[str, Any], *, source: str | None = None) -> SparseAttentionConfig:
    """Validate and parse a ``sparse_attention_config`` section that must hold a skip-softmax group.

    ``obj`` may be the section itself or a whole ``config.json`` dict holding it.
    ``source`` (e.g. the file path) is quoted in error messages. Unlike
    :func:`read_section` (what serving uses), anything without a skip-softmax
    group is an error here: this is the check for what we export.
    """
    root = SECTION_KEY
    if isinstance(obj, Mapping) and SECTION_KEY in obj and "config_groups" not in obj:
        obj = obj[SECTION_KEY]
    section = _require_mapping(obj, root, source, "with config_groups")
    groups = section.get("config_groups", MISSING)
    if not isinstance(groups, Mapping) or not groups:
        raise SparseAttentionConfigError(
            f"{root}.config_groups", groups, "a non-empty object of groups",
            'add "config_groups": {"group_0": {"algorithm": "skip_softmax", ...}}', source=source,
        )
    for name, group in groups.items():
        _require_mapping(group, f"{root}.config_groups.{name}", source, "one config group")
    _check_depth(section, source)
    config, _ = _parse_section(section, source)
    if config is None:
        name, group = next(iter(groups.items()))
        raise _unsupported_algorithm_error(str(name), group, root, source)
    return config


def _parse_section(section: Mapping[str, Any], source: str | None) -> tuple[SparseAttentionConfig | None, tuple[UnservedGroup, ...]]:
    root = SECTION_KEY
    groups: Mapping[str, Any] = section["config_groups"]
    chosen: tuple[int, str, Mapping[str, Any]] | None = None
    others: dict[str, Any] = {}
    for index, (name, group) in enumerate(groups.items()):
        if not _is_skip_softmax(group):
            others[str(name)] = group
            continue
        if chosen is not None:
            raise SparseAttentionConfigError(
                f"{root}.config_groups.{name}", dict(group), "at most one skip_softmax group (TensorRT-LLM allows one)",
                f"merge {short_repr(chosen[1], 60)} and {short_repr(str(name), 60)} into one group", source=source,
            )
        chosen = (index, str(name), group)
    unserved = tuple(UnservedGroup(name, group_algorithm(group)) for name, group in others.items())
    if chosen is None:
        return None, unserved
    position, name, group = chosen
    gpath = f"{root}.config_groups.{name}"

    # threshold_scale_factor: in the group (current) or at the section top (legacy ModelOpt)
    def pick(key_names: tuple[str, ...]) -> tuple[Any, str]:
        for mapping, prefix in ((group, gpath), (section, root)):
            for k in key_names:
                if k in mapping:
                    return mapping[k], f"{prefix}.{k}"
        return None, f"{gpath}.{key_names[0]}"

    tsf_value, tsf_path = pick(("threshold_scale_factor",))
    formula, fits = _parse_scale_factor(tsf_value, tsf_path, source)
    window_formula, window_fits = DEFAULT_FORMULA, None
    if group.get(WINDOW_CURVE_KEY) is not None:  # sparse-attn's own key, only in the group (never legacy)
        window_formula, window_fits = _parse_scale_factor(group[WINDOW_CURVE_KEY], f"{gpath}.{WINDOW_CURVE_KEY}", source)
    tgt_value, tgt_path = pick(("target_sparsity", "target_sparse_ratio"))
    targets = _parse_targets(tgt_value, tgt_path, source)

    producer = None
    if "producer" in section:
        praw = _require_mapping(section["producer"], f"{root}.producer", source, "{name, version}")
        pname = praw.get("name", MISSING)
        if not isinstance(pname, str) or not pname:
            raise SparseAttentionConfigError(f"{root}.producer.name", pname, "a non-empty string", "set the producer name", source=source)
        pver = praw.get("version")
        if pver is not None and not isinstance(pver, str):
            raise SparseAttentionConfigError(f"{root}.producer.version", pver, "a version string", 'write it as a string, e.g. "0.1.0"', source=source)
        producer = Producer(pname, pver)

    sk = SkipSoftmaxGroup(
        name=name,
        targets=pattern_list(group.get("targets"), f"{gpath}.targets", source),
        ignore=pattern_list(group.get("ignore"), f"{gpath}.ignore", source),
        formula=formula,
        fits=fits,
        window_fits=window_fits,
        window_formula=window_formula,
        target_sparsity=targets,
        extra={k: copy.deepcopy(v) for k, v in group.items() if k not in GROUP_KNOWN_KEYS},
    )
    config = SparseAttentionConfig(
        group=sk,
        producer=producer,
        extra={k: copy.deepcopy(v) for k, v in section.items() if k not in SECTION_KNOWN_KEYS},
        source=source,
        other_groups=others,
        group_position=position,
    )
    return config, unserved
