"""The ``sparse_attention_config`` section of a checkpoint's ``config.json``.

This is the calibration hand-off format written by NVIDIA ModelOpt and read by
TensorRT-LLM (and by this project): one or more ``config_groups``, at most one
of which uses the skip-softmax (BLASST) algorithm, carrying an exponential
calibration curve per phase::

    {
      "sparse_attention_config": {
        "config_groups": {
          "group_0": {
            "algorithm": "skip_softmax",
            "targets": ["LlamaAttention"],
            "ignore": ["model.layers.0.self_attn"],
            "threshold_scale_factor": {
              "formula": "a * exp(b * target_sparsity)",
              "prefill": {"a": 7.93, "b": 8.61},
              "decode": {"a": 0.12, "b": 9.85}
            },
            "target_sparsity": {"prefill": 0.5, "decode": 0.5}
          }
        },
        "producer": {"name": "sparse-attn", "version": "0.1.0"}
      }
    }

At run time the skip threshold of a phase is::

    scale  = a * exp(b * target_sparsity)      # "threshold_scale_factor"
    lambda = scale / kv_len                     # what the kernel compares against

Accepted input variants (all normalised to the layout above by ``to_dict``):

* **Per-group layout** (current ModelOpt / TensorRT-LLM): ``algorithm``,
  ``threshold_scale_factor``, ``target_sparsity`` inside the group.
* **Legacy ModelOpt layout**: the group says ``"sparse_algo": "softmax_skip"``
  and ``threshold_scale_factor`` / ``target_sparse_ratio`` sit at the top of
  the section. They are hoisted into the skip-softmax group.
* **Phase-agnostic coefficients** (TensorRT-LLM VisualGen):
  ``"threshold_scale_factor": {"formula": ..., "coefficients": {"a":..,"b":..}}``
  applies the same curve to both phases.
* ``target_sparsity`` as a scalar (both phases) or ``{"prefill":.., "decode":..}``.
* Formulas: ``a * exp(b * target_sparsity)`` (coefficients ``a``, ``b``) and
  ``exp(log_a + b * target_sparsity)`` (coefficients ``log_a``, ``b``); the
  comparison ignores whitespace. TensorRT-LLM evaluates arbitrary numexpr
  formulas; we deliberately do not evaluate arbitrary expressions, so any other
  formula is rejected with the list of supported ones.

Missing calibration for a phase (no coefficients) means that phase runs dense;
it is listed in :attr:`SparseAttentionConfig.missing_phases` so the caller can
log it once. A phase with coefficients but no target falls back to
``DEFAULT_TARGET_SPARSITY`` (0.5, ModelOpt's default for old checkpoints) and
is reported in :attr:`SparseAttentionConfig.warnings`.

Module matching (``targets`` / ``ignore``)
------------------------------------------
ModelOpt writes attention *class names* into ``targets`` (e.g.
``"LlamaAttention"``; ``"Attention"`` when the class was unknown) and
fnmatch patterns of *module names* into ``ignore``. A pattern matches a layer
when it

* starts with ``re:`` and the rest ``re.match``-es the layer name or one of
  the class names (compressed-tensors convention), or
* fnmatch-es (case-sensitive) one of the given class names, or
* fnmatch-es the layer name or any contiguous dotted part of it, so
  ``blocks.0.attn1`` matches ``transformer.blocks.0.attn1`` (component
  relative, as TensorRT-LLM documents) and ``model.layers.0.self_attn``
  matches the vLLM layer ``model.layers.0.self_attn.attn`` (the HF module
  that owns it).

The literal target ``"Attention"`` additionally matches any class name that
ends with ``Attention`` (ModelOpt's "unknown class" fallback). No ``targets``
means every attention layer is targeted. ``ignore`` wins over ``targets``.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from sparse_attn.protocol import PHASES

__all__ = [
    "DEFAULT_FORMULA",
    "DEFAULT_TARGET_SPARSITY",
    "PHASES",
    "SECTION_KEY",
    "SUPPORTED_ALGORITHMS",
    "SUPPORTED_FORMULAS",
    "PhaseFit",
    "Producer",
    "SkipSoftmaxGroup",
    "SparseAttentionConfig",
    "SparseAttentionConfigError",
    "load_from_checkpoint",
    "parse_sparse_attention_config",
]

SECTION_KEY = "sparse_attention_config"
DEFAULT_FORMULA = "a * exp(b * target_sparsity)"
LOG_FORMULA = "exp(log_a + b * target_sparsity)"
#: formula string (whitespace-insensitive) -> coefficient names it needs
SUPPORTED_FORMULAS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {DEFAULT_FORMULA: ("a", "b"), LOG_FORMULA: ("log_a", "b")}
)
#: canonical algorithm name -> accepted spellings
SUPPORTED_ALGORITHMS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"skip_softmax": ("skip_softmax", "softmax_skip")}
)
DEFAULT_TARGET_SPARSITY = 0.5

_GROUP_KNOWN_KEYS = {
    "algorithm",
    "sparse_algo",
    "targets",
    "ignore",
    "threshold_scale_factor",
    "target_sparsity",
    "target_sparse_ratio",
}
_SECTION_KNOWN_KEYS = {
    "config_groups",
    "producer",
    "threshold_scale_factor",
    "target_sparsity",
    "target_sparse_ratio",
}


class SparseAttentionConfigError(ValueError):
    """The ``sparse_attention_config`` section is malformed.

    The message names the key path, the bad value, what was expected and how
    to fix it. ``path`` holds the key path on its own.
    """

    def __init__(self, path: str, value: Any, expected: str, fix: str, *, source: str | None = None):
        self.path = path
        self.value = value
        self.expected = expected
        self.fix = fix
        self.source = source
        where = f" in {source}" if source else ""
        shown = _short_repr(value)
        super().__init__(f"{path}{where}: got {shown}; expected {expected}. Fix: {fix}")


def _short_repr(value: Any, limit: int = 120) -> str:
    if value is _MISSING:
        return "nothing (key is missing)"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Missing:
    def __repr__(self) -> str:  # pragma: no cover - only shown in messages
        return "<missing>"


_MISSING = _Missing()


# --------------------------------------------------------------------------- #
# dataclasses
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class PhaseFit:
    """Coefficients of ``scale = a * exp(b * target_sparsity)`` for one phase."""

    a: float
    b: float

    def scale(self, target_sparsity: float) -> float:
        """``threshold_scale_factor`` for ``target_sparsity``."""
        return self.a * math.exp(self.b * target_sparsity)


@dataclass(frozen=True)
class Producer:
    name: str
    version: str | None = None


@dataclass(frozen=True)
class SkipSoftmaxGroup:
    """One ``config_groups`` entry with ``algorithm: skip_softmax``."""

    name: str = "group_0"
    targets: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    formula: str = DEFAULT_FORMULA
    fits: Mapping[str, PhaseFit] = field(default_factory=dict, hash=False)
    target_sparsity: Mapping[str, float] = field(default_factory=dict, hash=False)
    #: keys of the group we do not interpret (e.g. ``initial_disabled_steps``), kept verbatim
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("fits", "target_sparsity", "extra"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


@dataclass(frozen=True)
class SparseAttentionConfig:
    """Parsed ``sparse_attention_config`` section (skip-softmax part)."""

    group: SkipSoftmaxGroup
    producer: Producer | None = None
    #: section-level keys we do not interpret, kept verbatim for ``to_dict``
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)
    #: where the section came from (quoted in messages; not part of equality)
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    # -- convenience views ------------------------------------------------- #
    @property
    def fits(self) -> Mapping[str, PhaseFit]:
        return self.group.fits

    @property
    def target_sparsity(self) -> Mapping[str, float]:
        return self.group.target_sparsity

    @property
    def missing_phases(self) -> tuple[str, ...]:
        """Phases without calibration coefficients; they run dense."""
        return tuple(p for p in PHASES if p not in self.group.fits)

    @property
    def calibrated_phases(self) -> tuple[str, ...]:
        return tuple(p for p in PHASES if p in self.group.fits)

    @property
    def warnings(self) -> tuple[str, ...]:
        """Human-readable notes worth logging once (missing phases, defaulted targets)."""
        notes = []
        for phase in self.missing_phases:
            notes.append(
                f"{SECTION_KEY}: no calibration for the {phase} phase; {phase} runs dense "
                f"(re-run `sparse-attn calibrate` with the {phase} phase enabled to sparsify it)"
            )
        for phase in self.calibrated_phases:
            if phase not in self.group.target_sparsity:
                notes.append(
                    f"{SECTION_KEY}: no target_sparsity for the {phase} phase; "
                    f"using the default {DEFAULT_TARGET_SPARSITY}"
                )
        return tuple(notes)

    def effective_target(self, phase: str, override: float | None = None) -> float | None:
        """Target sparsity used for ``phase`` (override > checkpoint > default); None if uncalibrated."""
        _check_phase(phase)
        if phase not in self.group.fits:
            return None
        if override is not None:
            _check_target(override, f"target_sparsity override for {phase}", "pass a value in [0, 1)")
            return float(override)
        return float(self.group.target_sparsity.get(phase, DEFAULT_TARGET_SPARSITY))

    def scale_factor(self, phase: str, target_sparsity: float | None = None) -> float | None:
        """``threshold_scale_factor`` of ``phase`` (``a * exp(b * target)``); None = dense."""
        target = self.effective_target(phase, target_sparsity)
        if target is None:
            return None
        return self.group.fits[phase].scale(target)

    def threshold(self, phase: str, kv_len: int, target_sparsity: float | None = None) -> float | None:
        """Skip threshold ``lambda = a * exp(b * target) / kv_len``; None when ``phase`` runs dense."""
        if isinstance(kv_len, bool) or not isinstance(kv_len, (int, float)) or not kv_len > 0:
            raise ValueError(f"kv_len must be a positive number of tokens, got {kv_len!r}")
        scale = self.scale_factor(phase, target_sparsity)
        if scale is None:
            return None
        return scale / kv_len

    def matches(self, layer_name: str, class_name: str | Iterable[str] | None = None) -> bool:
        """Whether the layer gets skip-softmax (targeted and not ignored).

        ``class_name`` may be a single class name or several (e.g. the vLLM
        layer class and the HF-style module class that owns it); any match counts.
        """
        return self.group_matches(self.group, layer_name, class_name)

    @staticmethod
    def group_matches(group: SkipSoftmaxGroup, layer_name: str, class_name: str | Iterable[str] | None) -> bool:
        if class_name is None:
            classes: tuple[str, ...] = ()
        elif isinstance(class_name, str):
            classes = (class_name,)
        else:
            classes = tuple(class_name)
        if any(_pattern_matches(p, layer_name, classes, is_target=False) for p in group.ignore):
            return False
        if not group.targets:
            return True
        return any(_pattern_matches(p, layer_name, classes, is_target=True) for p in group.targets)

    # -- serialisation ----------------------------------------------------- #
    def to_dict(self) -> dict[str, Any]:
        """Canonical section dict (per-group layout); ``parse(to_dict(c)) == c``."""
        g = self.group
        coef_names = SUPPORTED_FORMULAS[_normalise_formula(g.formula)]
        tsf: dict[str, Any] = {"formula": g.formula}
        for phase in PHASES:
            if phase in g.fits:
                fit = g.fits[phase]
                if coef_names[0] == "log_a":
                    tsf[phase] = {"log_a": math.log(fit.a), "b": fit.b}
                else:
                    tsf[phase] = {"a": fit.a, "b": fit.b}
        group: dict[str, Any] = {"algorithm": "skip_softmax"}
        if g.targets:
            group["targets"] = list(g.targets)
        if g.ignore:
            group["ignore"] = list(g.ignore)
        group["threshold_scale_factor"] = tsf
        if g.target_sparsity:
            group["target_sparsity"] = {p: g.target_sparsity[p] for p in PHASES if p in g.target_sparsity}
        group.update(copy.deepcopy(dict(g.extra)))
        out: dict[str, Any] = {"config_groups": {g.name: group}}
        if self.producer is not None:
            prod: dict[str, Any] = {"name": self.producer.name}
            if self.producer.version is not None:
                prod["version"] = self.producer.version
            out["producer"] = prod
        out.update(copy.deepcopy(dict(self.extra)))
        return out


# --------------------------------------------------------------------------- #
# matching
# --------------------------------------------------------------------------- #
def _dotted_parts(name: str) -> list[str]:
    parts = name.split(".")
    n = len(parts)
    return [".".join(parts[i:j]) for i in range(n) for j in range(i + 1, n + 1)]


def _pattern_matches(pattern: str, layer_name: str, classes: tuple[str, ...], *, is_target: bool) -> bool:
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return bool(rx.match(layer_name)) or any(rx.match(c) for c in classes)
    for cls in classes:
        if fnmatch.fnmatchcase(cls, pattern):
            return True
        if is_target and pattern == "Attention" and cls.endswith("Attention"):
            return True
    if layer_name:
        return any(fnmatch.fnmatchcase(part, pattern) for part in _dotted_parts(layer_name))
    return False


# --------------------------------------------------------------------------- #
# parsing
# --------------------------------------------------------------------------- #
def _normalise_formula(formula: str) -> str:
    squashed = "".join(formula.split())
    for known in SUPPORTED_FORMULAS:
        if "".join(known.split()) == squashed:
            return known
    raise KeyError(formula)


def _check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: Any, path: str, source: str | None, *, positive: bool = False) -> float:
    if not _is_number(value):
        raise SparseAttentionConfigError(
            path, value, "a number", "write a JSON number (not a string or null)", source=source
        )
    value = float(value)
    if not math.isfinite(value):
        raise SparseAttentionConfigError(
            path, value, "a finite number", "re-run calibration; the fit diverged", source=source
        )
    if positive and value <= 0:
        raise SparseAttentionConfigError(
            path, value, "a number > 0", "re-run calibration; a must be positive", source=source
        )
    return value


def _check_target(value: Any, path: str, fix: str, source: str | None = None) -> float:
    value = _number(value, path, source)
    if not 0.0 <= value < 1.0:
        raise SparseAttentionConfigError(path, value, "a sparsity in [0, 1)", fix, source=source)
    return value


def _require_mapping(value: Any, path: str, source: str | None, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SparseAttentionConfigError(path, value, f"a JSON object ({what})", f"make {path} an object", source=source)
    return value


def _pattern_list(value: Any, path: str, source: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise SparseAttentionConfigError(
            path, value, "a list of non-empty pattern strings", 'write e.g. ["LlamaAttention"] or ["model.layers.0.*"]', source=source
        )
    for v in value:
        if v.startswith("re:"):
            try:
                re.compile(v[3:])
            except re.error as exc:
                raise SparseAttentionConfigError(path, v, f"a valid regular expression after 're:' ({exc})", "fix the regex", source=source) from None
    return tuple(value)


def _parse_algorithm(group: Mapping[str, Any], path: str, source: str | None) -> str:
    if "algorithm" in group:
        key = "algorithm"
    elif "sparse_algo" in group:
        key = "sparse_algo"
    else:
        raise SparseAttentionConfigError(
            f"{path}.algorithm", _MISSING, 'an "algorithm" key', 'add "algorithm": "skip_softmax"', source=source
        )
    raw = group[key]
    for canonical, spellings in SUPPORTED_ALGORITHMS.items():
        if raw in spellings:
            return canonical
    supported = ", ".join(repr(s) for spellings in SUPPORTED_ALGORITHMS.values() for s in spellings)
    raise SparseAttentionConfigError(
        f"{path}.{key}",
        raw,
        f"a supported algorithm ({supported})",
        "this runtime only implements skip-softmax; remove the group or serve the checkpoint with a runtime that supports it",
        source=source,
    )


def _parse_targets(value: Any, path: str, source: str | None) -> dict[str, float]:
    if value is None:
        return {}
    if _is_number(value):
        t = _check_target(value, path, "set target_sparsity to a value in [0, 1), e.g. 0.5", source)
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
        out[key] = _check_target(v, f"{path}.{key}", "set target_sparsity to a value in [0, 1), e.g. 0.5", source)
    return out


def _parse_coefficients(coefs: Any, names: tuple[str, str], path: str, source: str | None) -> PhaseFit:
    mapping = _require_mapping(coefs, path, source, f"coefficients {list(names)}")
    values = {}
    for name in names:
        if name not in mapping:
            raise SparseAttentionConfigError(
                f"{path}.{name}", _MISSING, f"coefficient {name!r} (the formula uses {list(names)})",
                "re-run calibration or add the coefficient", source=source,
            )
        values[name] = _number(mapping[name], f"{path}.{name}", source, positive=(name == "a"))
    if names[0] == "log_a":
        a = math.exp(values["log_a"])
        if not (math.isfinite(a) and a > 0):
            raise SparseAttentionConfigError(f"{path}.log_a", values["log_a"], "exp(log_a) finite and > 0", "re-run calibration", source=source)
    else:
        a = values["a"]
    return PhaseFit(a=a, b=values["b"])


def _parse_scale_factor(value: Any, path: str, source: str | None) -> tuple[str, dict[str, PhaseFit]]:
    if value is None:
        return DEFAULT_FORMULA, {}
    if _is_number(value):
        raise SparseAttentionConfigError(
            path, value, "a calibration curve {formula, prefill: {a, b}, decode: {a, b}}",
            "a fixed scale factor is a runtime option (--threshold-scale-factor), not checkpoint calibration; "
            "run `sparse-attn calibrate` to produce a curve", source=source,
        )
    mapping = _require_mapping(value, path, source, "formula and per-phase coefficients")
    formula = mapping.get("formula", _MISSING)
    if not isinstance(formula, str):
        raise SparseAttentionConfigError(
            f"{path}.formula", formula, f"a formula string, one of {list(SUPPORTED_FORMULAS)}",
            f'add "formula": "{DEFAULT_FORMULA}"', source=source,
        )
    try:
        formula_key = _normalise_formula(formula)
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


def parse_sparse_attention_config(obj: Mapping[str, Any], *, source: str | None = None) -> SparseAttentionConfig:
    """Validate and parse a ``sparse_attention_config`` section.

    ``obj`` may be the section itself or a whole ``config.json`` dict holding it.
    ``source`` (e.g. the file path) is quoted in error messages.
    """
    root = SECTION_KEY
    if isinstance(obj, Mapping) and SECTION_KEY in obj and "config_groups" not in obj:
        obj = obj[SECTION_KEY]
    section = _require_mapping(obj, root, source, "with config_groups")
    groups = section.get("config_groups", _MISSING)
    if not isinstance(groups, Mapping) or not groups:
        raise SparseAttentionConfigError(
            f"{root}.config_groups", groups, "a non-empty object of groups",
            'add "config_groups": {"group_0": {"algorithm": "skip_softmax", ...}}', source=source,
        )
    chosen: tuple[str, Mapping[str, Any]] | None = None
    for name, group in groups.items():
        gpath = f"{root}.config_groups.{name}"
        group = _require_mapping(group, gpath, source, "one config group")
        _parse_algorithm(group, gpath, source)  # raises for unknown algorithms
        if chosen is not None:
            raise SparseAttentionConfigError(
                gpath, dict(group), "at most one skip_softmax group",
                f"merge {chosen[0]!r} and {name!r} into one group", source=source,
            )
        chosen = (name, group)
    assert chosen is not None
    name, group = chosen
    gpath = f"{root}.config_groups.{name}"

    # threshold_scale_factor: in the group (current) or at the section top (legacy ModelOpt)
    def pick(key_names: tuple[str, ...]) -> tuple[Any, str]:
        for where, mapping, prefix in ((group, group, gpath), (section, section, root)):
            for k in key_names:
                if k in mapping:
                    return mapping[k], f"{prefix}.{k}"
        return None, f"{gpath}.{key_names[0]}"

    tsf_value, tsf_path = pick(("threshold_scale_factor",))
    formula, fits = _parse_scale_factor(tsf_value, tsf_path, source)
    tgt_value, tgt_path = pick(("target_sparsity", "target_sparse_ratio"))
    targets = _parse_targets(tgt_value, tgt_path, source)

    producer = None
    if "producer" in section:
        praw = _require_mapping(section["producer"], f"{root}.producer", source, "{name, version}")
        pname = praw.get("name", _MISSING)
        if not isinstance(pname, str) or not pname:
            raise SparseAttentionConfigError(f"{root}.producer.name", pname, "a non-empty string", "set the producer name", source=source)
        pver = praw.get("version")
        if pver is not None and not isinstance(pver, str):
            raise SparseAttentionConfigError(f"{root}.producer.version", pver, "a version string", 'write it as a string, e.g. "0.1.0"', source=source)
        producer = Producer(pname, pver)

    sk = SkipSoftmaxGroup(
        name=str(name),
        targets=_pattern_list(group.get("targets"), f"{gpath}.targets", source),
        ignore=_pattern_list(group.get("ignore"), f"{gpath}.ignore", source),
        formula=formula,
        fits=fits,
        target_sparsity=targets,
        extra={k: copy.deepcopy(v) for k, v in group.items() if k not in _GROUP_KNOWN_KEYS},
    )
    return SparseAttentionConfig(
        group=sk,
        producer=producer,
        extra={k: copy.deepcopy(v) for k, v in section.items() if k not in _SECTION_KNOWN_KEYS},
        source=source,
    )


def load_from_checkpoint(ckpt_dir: str | Path) -> SparseAttentionConfig | None:
    """Parse ``sparse_attention_config`` from ``ckpt_dir/config.json``; None when absent.

    Raises ``SparseAttentionConfigError`` when config.json is missing, not
    JSON, or the section is malformed.
    """
    path = Path(ckpt_dir) / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SparseAttentionConfigError(
            "config.json", str(path), "an existing file", "point at a Hugging Face checkpoint directory that contains config.json"
        ) from None
    except OSError as exc:
        raise SparseAttentionConfigError("config.json", str(path), f"a readable file ({exc.strerror})", "check permissions") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SparseAttentionConfigError(
            "config.json", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", "valid JSON",
            "repair or re-download config.json", source=str(path),
        ) from None
    if not isinstance(data, dict):
        raise SparseAttentionConfigError("config.json", type(data).__name__, "a JSON object at the top level", "repair config.json", source=str(path))
    if data.get(SECTION_KEY) is None:
        return None
    return parse_sparse_attention_config(data[SECTION_KEY], source=str(path))
