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

Whose section is it?
--------------------
The key ``sparse_attention_config`` is shared: vLLM's MiniMax-M3 config uses
it for its own sparse attention (``use_sparse_attention``,
``sparse_topk_blocks``, ...; no ``config_groups``). A section is ModelOpt /
TensorRT-LLM metadata only by its *shape*: ``config_groups`` whose groups carry
``algorithm`` or ``sparse_algo``. Anything else is not ours:
:func:`read_section` says so in one line and the model keeps native
attention. (Qwen dual-chunk attention reads a separate *file*,
``sparse_attention_config.json``; nothing here reads or writes that file.)

Several groups: ModelOpt exports e.g. an N:M ``sparse_softmax`` group beside
the skip-softmax one. We serve the (single) skip-softmax group and report
every other group with its algorithm (:attr:`SparseAttentionConfig.unserved_groups`);
``to_dict`` keeps those groups verbatim, in their original order.

Bounds
------
A curve is rejected unless ``ln(scale) = ln(a) + b * t`` stays within
``[-LN_SCALE_BOUND, LN_SCALE_BOUND]`` for every target ``t`` in ``[0, 1]``, so
the scale factor (and lambda) is a finite, non-zero float at every target a
runtime override can ask for. ``re:`` patterns are checked before any match:
nested quantifiers, alternation inside a repeat and back-references (which
backtrack exponentially) are rejected, as are more than
``MAX_UNBOUNDED_REPEATS`` unbounded repeats or patterns longer than
``MAX_PATTERN_LENGTH``, because every worker matches every layer at start-up
and Python's ``re`` cannot be interrupted.

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
    "DISABLE_HINT",
    "LN_SCALE_BOUND",
    "MAX_PATTERN_LENGTH",
    "MAX_UNBOUNDED_REPEATS",
    "DEFAULT_TARGET_SPARSITY",
    "PHASES",
    "SECTION_KEY",
    "SUPPORTED_ALGORITHMS",
    "SUPPORTED_FORMULAS",
    "PhaseFit",
    "Producer",
    "SkipSoftmaxGroup",
    "SparseAttentionConfig",
    "SectionReading",
    "SparseAttentionConfigError",
    "UnservedGroup",
    "is_modelopt_section",
    "load_from_checkpoint",
    "parse_sparse_attention_config",
    "read_config_json",
    "read_section",
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
#: |ln(scale)| allowed at any target in [0, 1]: exp(700) ~ 1e304 and exp(-700) ~ 1e-304
#: are finite, non-zero doubles (math.exp overflows above ~709.78).
LN_SCALE_BOUND = 700.0
#: Longest ``re:`` pattern accepted (layer names are ~30-100 characters).
MAX_PATTERN_LENGTH = 256
#: Unbounded repeats (``*``, ``+``, ``{n,}``) allowed in one ``re:`` pattern. Each one in
#: sequence multiplies the backtracking work by the name length: four ``.*`` take ~15 ms on a
#: 100-character name, five ~0.2 s, six seconds (measured, CPython 3.11).
MAX_UNBOUNDED_REPEATS = 3
#: How a user switches the plugin off when a start-up error blocks serving.
DISABLE_HINT = "or set SPARSE_ATTN_DISABLE=1 to serve with native attention"

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
class UnservedGroup:
    """A ``config_groups`` entry this runtime does not serve (e.g. ModelOpt's N:M ``sparse_softmax``)."""

    name: str
    #: the group's ``algorithm`` / ``sparse_algo`` value as written (None: the group has neither)
    algorithm: Any = None

    def message(self, root: str = SECTION_KEY) -> str:
        what = f"algorithm {self.algorithm!r}" if self.algorithm is not None else "no algorithm key"
        return (
            f"{root}.config_groups.{self.name} ({what}) is not served: this runtime implements only "
            f"skip_softmax, so this group's sparsity is not applied (set SPARSE_ATTN_STRICT=1 to make "
            f"this an error)"
        )


@dataclass(frozen=True)
class SparseAttentionConfig:
    """Parsed ``sparse_attention_config`` section: the skip-softmax group we serve,
    plus every other group kept verbatim."""

    group: SkipSoftmaxGroup
    producer: Producer | None = None
    #: section-level keys we do not interpret, kept verbatim for ``to_dict``
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)
    #: where the section came from (quoted in messages; not part of equality)
    source: str | None = field(default=None, compare=False)
    #: the other ``config_groups`` entries (name -> group as written), in file order
    other_groups: Mapping[str, Any] = field(default_factory=dict, hash=False)
    #: index of the skip-softmax group among all groups, so ``to_dict`` keeps the file order
    group_position: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))
        object.__setattr__(self, "other_groups", MappingProxyType(copy.deepcopy(dict(self.other_groups))))

    @property
    def unserved_groups(self) -> tuple[UnservedGroup, ...]:
        """The groups we do not serve, with their algorithm (reported once at start-up)."""
        return tuple(UnservedGroup(name, _group_algorithm(group)) for name, group in self.other_groups.items())

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
        """Human-readable notes worth logging once: missing phases, defaulted targets,
        curves that do not grow with the target, groups we do not serve."""
        notes = []
        for phase in self.missing_phases:
            notes.append(
                f"{SECTION_KEY}: no calibrated threshold for the {phase} phase; it runs dense "
                f"(re-run `sparse-attn calibrate` with --decode_tokens > 0 to calibrate decode)"
                if phase == "decode" else
                f"{SECTION_KEY}: no calibrated threshold for the {phase} phase; it runs dense "
                f"(re-run `sparse-attn calibrate` to calibrate it)"
            )
        for phase in self.calibrated_phases:
            if phase not in self.group.target_sparsity:
                notes.append(
                    f"{SECTION_KEY}: no target_sparsity for the {phase} phase; "
                    f"using the default {DEFAULT_TARGET_SPARSITY}"
                )
        for phase in self.calibrated_phases:
            b = self.group.fits[phase].b
            if b <= 0:
                notes.append(
                    f"{self._tsf_path(phase)}.b is {b!r}: the scale factor does not grow with target_sparsity, "
                    f"so no target makes the {phase} phase skip more tiles than at target 0 (a calibrated curve "
                    f"has b > 0). Fix: re-run `sparse-attn calibrate`"
                )
        notes.extend(g.message() for g in self.unserved_groups)
        return tuple(notes)

    def never_skip_warnings(self, max_kv_len: int | None) -> tuple[str, ...]:
        """Phases that can never skip a tile at any KV length up to ``max_kv_len`` tokens.

        The kernel skips only where ``lambda = scale / kv_len < 1``, so a phase
        whose scale factor at its target is ``>= max_kv_len`` runs dense for every
        request the model can take. ``max_kv_len`` is the longest KV length served
        (vLLM's ``max_model_len``, or the checkpoint's ``max_position_embeddings``);
        None skips the check.
        """
        if max_kv_len is None or isinstance(max_kv_len, bool) or not isinstance(max_kv_len, int) or max_kv_len <= 0:
            return ()
        notes = []
        for phase in self.calibrated_phases:
            target = self.effective_target(phase)
            scale = self.scale_factor(phase)
            if scale is not None and scale >= max_kv_len:
                notes.append(
                    f"{self._tsf_path(phase)}: at target_sparsity {target:g} the {phase} scale factor is {scale:.4g}, "
                    f"so lambda = scale / kv_len >= 1 for every KV length up to {max_kv_len} tokens and the {phase} "
                    f"phase never skips a tile (it runs dense). Fix: lower target_sparsity, or re-run "
                    f"`sparse-attn calibrate` on this model"
                )
        return tuple(notes)

    def _tsf_path(self, phase: str) -> str:
        return f"{SECTION_KEY}.config_groups.{self.group.name}.threshold_scale_factor.{phase}"

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
        others = list(copy.deepcopy(dict(self.other_groups)).items())
        position = min(max(self.group_position, 0), len(others))
        ordered = others[:position] + [(g.name, group)] + others[position:]
        out: dict[str, Any] = {"config_groups": dict(ordered)}
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
        rx = re.compile(pattern[3:])  # re caches compiled patterns; the parser vetted this one
        return bool(rx.match(layer_name)) or any(rx.match(c) for c in classes)
    for cls in classes:
        if fnmatch.fnmatchcase(cls, pattern):
            return True
        if is_target and pattern == "Attention" and cls.endswith("Attention"):
            return True
    if layer_name:
        return any(fnmatch.fnmatchcase(part, pattern) for part in _dotted_parts(layer_name))
    return False


try:  # the regex parser CPython's re uses: re._parser from 3.11, sre_parse before
    from re import _constants as _sre_c
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

_REPEAT_OPS = tuple(
    getattr(_sre_c, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(_sre_c, name)
)
_BACKREF_OPS = tuple(getattr(_sre_c, name) for name in ("GROUPREF", "GROUPREF_EXISTS", "GROUPREF_IGNORE",
                                                         "GROUPREF_LOC_IGNORE", "GROUPREF_UNI_IGNORE")
                     if hasattr(_sre_c, name))


def _regex_hazard(regex: str) -> str | None:
    """Why matching ``regex`` could backtrack for a long time, or None when it cannot.

    Python's ``re`` backtracks: a repeat around something that can itself match
    in several ways (another repeat, an alternation) tries exponentially many
    splits on a near-miss (``([a-z._0-9]+)*X`` takes ~18 s on a 29-character
    name), back-references make matching NP-hard, and each unbounded repeat in
    sequence multiplies the work by the name length. Matching cannot be
    interrupted (it holds the GIL in C), so the pattern is vetted up front.
    """
    if len(regex) > MAX_PATTERN_LENGTH:
        return f"a pattern of at most {MAX_PATTERN_LENGTH} characters (this one has {len(regex)})"
    unbounded = 0

    def walk(sub: Any, in_repeat: bool) -> str | None:
        nonlocal unbounded
        for op, av in sub:
            if op in _REPEAT_OPS:
                lo, hi, body = av
                if hi > 1:
                    if in_repeat:
                        return "no nested quantifiers (a repeat inside a repeated group backtracks exponentially)"
                    if hi == _sre_c.MAXREPEAT:
                        unbounded += 1
                found = walk(body, in_repeat or hi > 1)
            elif op == _sre_c.BRANCH:
                if in_repeat and len(av[1]) > 1:
                    return "no alternation inside a repeated group (it backtracks exponentially); use a character class"
                found = next((why for branch in av[1] if (why := walk(branch, in_repeat))), None)
            elif op == _sre_c.SUBPATTERN:
                found = walk(av[3], in_repeat)
            elif op in (_sre_c.ASSERT, _sre_c.ASSERT_NOT):
                found = walk(av[1], in_repeat)
            elif op == getattr(_sre_c, "ATOMIC_GROUP", object()):
                found = walk(av, in_repeat)
            elif op in _BACKREF_OPS:
                return "no back-references (matching them can take exponential time)"
            else:
                found = None
            if found:
                return found
        return None

    why = walk(_sre_parse.parse(regex), False)
    if why is None and unbounded > MAX_UNBOUNDED_REPEATS:
        why = (f"at most {MAX_UNBOUNDED_REPEATS} unbounded repeats (*, +, {{n,}}); this one has {unbounded}, "
               f"and each multiplies the matching time by the layer-name length")
    return why


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
    try:
        value = float(value)
    except OverflowError:  # a JSON integer beyond the double range, e.g. 10**400
        raise SparseAttentionConfigError(
            path, value, "a number within the double-precision range (|x| < 1.8e308)",
            "re-run calibration; the fit diverged", source=source,
        ) from None
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
            hazard = _regex_hazard(v[3:])
            if hazard:
                raise SparseAttentionConfigError(
                    path, v, f"a regular expression that matches in bounded time: {hazard}",
                    "write the pattern without nesting, e.g. 're:[a-z._0-9]*X' instead of 're:([a-z._0-9]+)*X', "
                    "list several patterns instead of one alternation, or use an fnmatch pattern such as "
                    "'model.layers.*.self_attn'", source=source,
                )
    return tuple(value)


def _algorithm_key(group: Any) -> str | None:
    """Which key of ``group`` names its algorithm (current ``algorithm``, legacy ``sparse_algo``)."""
    if isinstance(group, Mapping):
        for key in ("algorithm", "sparse_algo"):
            if key in group:
                return key
    return None


def _group_algorithm(group: Any) -> Any:
    key = _algorithm_key(group)
    return group[key] if key is not None else None


def _is_skip_softmax(group: Any) -> bool:
    raw = _group_algorithm(group)
    return isinstance(raw, str) and any(raw in spellings for spellings in SUPPORTED_ALGORITHMS.values())


def _unsupported_algorithm_error(name: str, group: Any, root: str, source: str | None) -> SparseAttentionConfigError:
    gpath = f"{root}.config_groups.{name}"
    key = _algorithm_key(group)
    if key is None:
        return SparseAttentionConfigError(
            f"{gpath}.algorithm", _MISSING, 'an "algorithm" key', 'add "algorithm": "skip_softmax"', source=source
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
    if _is_number(value):
        raise SparseAttentionConfigError(
            path, value, "a calibration curve {formula, prefill: {a, b}, decode: {a, b}}",
            "a single number is not a calibration; run `sparse-attn calibrate CKPT --update_checkpoint_config` "
            "to write the curve, or write {formula, prefill: {a, b}, decode: {a, b}} yourself", source=source,
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


def is_modelopt_section(section: Any) -> bool:
    """Whether ``section`` has the shape of ModelOpt / TensorRT-LLM sparse-attention metadata:
    ``config_groups`` with at least one group carrying ``algorithm`` or ``sparse_algo``.

    Other users of the key (MiniMax-M3's ``{"use_sparse_attention": true, ...}``) are not ours.
    """
    if not isinstance(section, Mapping):
        return False
    groups = section.get("config_groups")
    return isinstance(groups, Mapping) and any(_algorithm_key(g) is not None for g in groups.values())


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


def _foreign_note(section: Any) -> str:
    if isinstance(section, Mapping):
        keys = ", ".join(sorted(map(str, section))[:6]) or "none"
        shape = f"an object with keys {keys}"
    else:
        shape = f"a {type(section).__name__}"
    return (
        f"{SECTION_KEY} is {shape}, not ModelOpt / TensorRT-LLM skip-softmax metadata (config_groups whose "
        f"groups carry an algorithm); it belongs to the model itself, so sparse-attn leaves vLLM attention native"
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
        return SectionReading(None, ours=False, note=_foreign_note(section))
    config, unserved = _parse_section(section, source)
    if config is None:
        listed = ", ".join(f"{g.name} ({g.algorithm!r})" if g.algorithm is not None else f"{g.name} (no algorithm)"
                           for g in unserved)
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
    groups = section.get("config_groups", _MISSING)
    if not isinstance(groups, Mapping) or not groups:
        raise SparseAttentionConfigError(
            f"{root}.config_groups", groups, "a non-empty object of groups",
            'add "config_groups": {"group_0": {"algorithm": "skip_softmax", ...}}', source=source,
        )
    for name, group in groups.items():
        _require_mapping(group, f"{root}.config_groups.{name}", source, "one config group")
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
                f"merge {chosen[1]!r} and {name!r} into one group", source=source,
            )
        chosen = (index, str(name), group)
    unserved = tuple(UnservedGroup(name, _group_algorithm(group)) for name, group in others.items())
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
        name=name,
        targets=_pattern_list(group.get("targets"), f"{gpath}.targets", source),
        ignore=_pattern_list(group.get("ignore"), f"{gpath}.ignore", source),
        formula=formula,
        fits=fits,
        target_sparsity=targets,
        extra={k: copy.deepcopy(v) for k, v in group.items() if k not in _GROUP_KNOWN_KEYS},
    )
    config = SparseAttentionConfig(
        group=sk,
        producer=producer,
        extra={k: copy.deepcopy(v) for k, v in section.items() if k not in _SECTION_KNOWN_KEYS},
        source=source,
        other_groups=others,
        group_position=position,
    )
    return config, unserved


def read_config_json(ckpt_dir: str | Path) -> dict[str, Any]:
    """``ckpt_dir/config.json`` as a dict (only that file: never the Qwen dual-chunk
    ``sparse_attention_config.json`` beside it).

    Raises ``SparseAttentionConfigError`` when config.json is missing, unreadable,
    not JSON, or not an object.
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
    return data


def load_from_checkpoint(ckpt_dir: str | Path) -> SparseAttentionConfig | None:
    """The skip-softmax config in ``ckpt_dir/config.json``; None when the section is
    absent, belongs to someone else, or has no skip-softmax group.

    Raises ``SparseAttentionConfigError`` when config.json is missing, not
    JSON, or the skip-softmax group is malformed.
    """
    path = Path(ckpt_dir) / "config.json"
    return read_section(read_config_json(ckpt_dir).get(SECTION_KEY), source=str(path)).config
