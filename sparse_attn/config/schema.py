"""The parsed form of a ``sparse_attention_config`` section: constants, the frozen
dataclasses, and the value checks they share with the parser."""

from __future__ import annotations

import copy
import difflib
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from sparse_attn.protocol import PHASES

from .errors import SparseAttentionConfigError, short_repr, short_text
from .targeting import group_matches

__all__ = [
    "DEFAULT_FORMULA", "DEFAULT_TARGET_SPARSITY", "DISABLE_HINT", "GROUP_KNOWN_KEYS", "LN_SCALE_BOUND", "LOG_FORMULA",
    "SECTION_KEY", "SECTION_KNOWN_KEYS", "SUPPORTED_ALGORITHMS", "WINDOW_CURVE_KEY", "SUPPORTED_FORMULAS", "PhaseFit", "Producer",
    "SkipSoftmaxGroup", "SparseAttentionConfig", "UnservedGroup", "algorithm_key", "check_phase", "check_target",
    "group_algorithm", "is_number", "normalise_formula", "number",
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
#: How a user switches the plugin off when a start-up error blocks serving.
DISABLE_HINT = "or set SPARSE_ATTN_DISABLE=1 to serve with native attention"

#: The group key of the curve of sliding-window layers (sparse-attn's own; ModelOpt and
#: TensorRT-LLM read the group's keys they know and ignore this one). Same shape as
#: ``threshold_scale_factor``; on a windowed layer ``lambda = scale / min(kv_len, window)``.
#: Why a second curve: on Gemma-3-270M at a 50 % decode target one pooled ``scale / kv_len``
#: curve gives global / windowed layers 65.5 % / 35.3 % on held-out prompts, a curve per kind
#: normalised by ``min(kv_len, window)`` 51.9 % / 46.4 % (``benchmarks/window_lambda_heldout.py``).
WINDOW_CURVE_KEY = "sliding_window_threshold_scale_factor"

GROUP_KNOWN_KEYS = {
    "algorithm",
    WINDOW_CURVE_KEY,
    "sparse_algo",
    "targets",
    "ignore",
    "threshold_scale_factor",
    "target_sparsity",
    "target_sparse_ratio",
}
SECTION_KNOWN_KEYS = {
    "config_groups",
    "producer",
    "threshold_scale_factor",
    "target_sparsity",
    "target_sparse_ratio",
}


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
    #: the sliding-window layers' own curve (``WINDOW_CURVE_KEY``); ``None`` = none written, and
    #: windowed layers use ``fits`` with ``lambda = scale / kv_len`` (TensorRT-LLM's rule)
    window_fits: Mapping[str, PhaseFit] | None = field(default=None, hash=False)
    window_formula: str = DEFAULT_FORMULA

    def __post_init__(self) -> None:
        if self.window_fits is not None:
            object.__setattr__(self, "window_fits", MappingProxyType(dict(self.window_fits)))
        for name in ("fits", "target_sparsity", "extra"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


@dataclass(frozen=True)
class UnservedGroup:
    """A ``config_groups`` entry this runtime does not serve (e.g. ModelOpt's N:M ``sparse_softmax``)."""

    name: str
    #: the group's ``algorithm`` / ``sparse_algo`` value as written (None: the group has neither)
    algorithm: Any = None

    @property
    def label(self) -> str:
        """``name (algorithm 'x')``, inputs cut to a readable length."""
        what = f"algorithm {short_repr(self.algorithm, 60)}" if self.algorithm is not None else "no algorithm key"
        return f"{short_text(self.name, 60)} ({what})"

    def message(self, root: str = SECTION_KEY) -> str:
        return (
            f"{root}.config_groups.{self.label} is not served: this runtime implements only "
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
        return tuple(UnservedGroup(name, group_algorithm(group)) for name, group in self.other_groups.items())

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
    def has_window_curve(self) -> bool:
        """Whether the group carries the sliding-window layers' own curve (``WINDOW_CURVE_KEY``)."""
        return self.group.window_fits is not None

    def curve(self, windowed: bool = False) -> Mapping[str, PhaseFit]:
        """The per-phase coefficients a layer uses: the window curve for a sliding-window layer
        when the group has one, else ``threshold_scale_factor``'s."""
        if windowed and self.group.window_fits is not None:
            return self.group.window_fits
        return self.group.fits

    def _curves(self) -> tuple[tuple[str, Mapping[str, PhaseFit]], ...]:
        """(key path, fits) of each curve the group carries, main first."""
        g = self.group
        main = (f"{SECTION_KEY}.config_groups.{g.name}.threshold_scale_factor", g.fits)
        if g.window_fits is None:
            return (main,)
        return main, (f"{SECTION_KEY}.config_groups.{g.name}.{WINDOW_CURVE_KEY}", g.window_fits)

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
        if self.group.window_fits is not None:
            for phase in PHASES:
                if phase not in self.group.window_fits:
                    notes.append(
                        f"{SECTION_KEY}.config_groups.{self.group.name}.{WINDOW_CURVE_KEY} has no {phase} curve; "
                        f"sliding-window layers run the {phase} phase dense (re-run `sparse-attn calibrate`)"
                    )
        for phase in PHASES:
            if phase not in self.group.target_sparsity and any(phase in fits for _, fits in self._curves()):
                notes.append(
                    f"{SECTION_KEY}: no target_sparsity for the {phase} phase; "
                    f"using the default {DEFAULT_TARGET_SPARSITY}"
                )
        for path, fits in self._curves():
            for phase in PHASES:
                if phase in fits and fits[phase].b <= 0:
                    notes.append(
                        f"{path}.{phase}.b is {fits[phase].b!r}: the scale factor does not grow with target_sparsity, "
                        f"so no target makes the {phase} phase skip more tiles than at target 0 (a calibrated curve "
                        f"has b > 0). Fix: re-run `sparse-attn calibrate`"
                    )
        notes.extend(self.suspect_keys)
        notes.extend(g.message() for g in self.unserved_groups)
        return tuple(notes)

    @property
    def suspect_keys(self) -> tuple[str, ...]:
        """Unknown keys of the skip-softmax group or the section that are near misses of a key
        this runtime reads (``"ignor"``, ``"targts"``, ``"Targets"``): kept verbatim like every
        unknown key, but almost certainly meant as the known one, whose absence changes which
        layers run sparse. Warnings; errors under ``SPARSE_ATTN_STRICT=1``."""
        notes = []
        for prefix, keys, known in (
            (f"{SECTION_KEY}.config_groups.{short_text(self.group.name, 60)}", self.group.extra, GROUP_KNOWN_KEYS),
            (SECTION_KEY, self.extra, SECTION_KNOWN_KEYS),
        ):
            for key in keys:
                close = _closest(key, known)
                if close is not None:
                    notes.append(
                        f"{prefix}.{key} is not a key sparse-attn reads (it is kept verbatim and has no effect); "
                        f"did you mean {close!r}? Without it, {_WITHOUT.get(close, 'its default applies')} "
                        f"(SPARSE_ATTN_STRICT=1 makes this an error)"
                    )
        return tuple(notes)

    def never_skip_warnings(self, max_kv_len: int | None) -> tuple[str, ...]:
        """Phases that can never skip a tile at any KV length up to ``max_kv_len`` tokens.

        The kernel skips only where ``lambda = scale / kv_len < 1`` (``scale / min(kv_len,
        window)`` on a layer served by the window curve, never a larger normaliser), so a
        phase whose scale factor at its target is ``>= max_kv_len`` runs dense for every
        request the model can take. ``max_kv_len`` is the longest KV length served
        (the worker's ``max_model_len``; before start-up ``--max-model-len`` or
        ``compat.launch.model_length_limit``); None skips the check.
        """
        notes = []
        main = self._curves()[0][0]
        for path, phase, scale in self._never_skipping(max_kv_len):
            target = self.effective_target(phase)
            rule, layers = ("scale / kv_len", "") if path == main else \
                ("scale / min(kv_len, window)", " of the sliding-window layers")
            notes.append(
                f"{path}.{phase}: at target_sparsity {target:g} the {phase} scale factor is {scale:.4g}, "
                f"so lambda = {rule} >= 1 for every KV length up to {max_kv_len} tokens and the {phase} "
                f"phase{layers} never skips a tile (it runs dense). Fix: lower target_sparsity, or re-run "
                f"`sparse-attn calibrate` on this model"
            )
        return tuple(notes)

    def never_skipping_phases(self, max_kv_len: int | None) -> tuple[str, ...]:
        """The phases of the main curve (``threshold_scale_factor``) whose scale factor at their target is
        ``>= max_kv_len`` (tokens): ``lambda = scale / kv_len >= 1`` at every KV length served, which the
        kernels run dense (``kernels.checks.effective_lambda``). A target beyond the sparsity calibration
        observed extrapolates the curve there. None / non-positive ``max_kv_len``: none (unknown length)."""
        main = self._curves()[0][0]
        return tuple(phase for path, phase, _ in self._never_skipping(max_kv_len) if path == main)

    def _never_skipping(self, max_kv_len: int | None) -> list[tuple[str, str, float]]:
        if max_kv_len is None or isinstance(max_kv_len, bool) or not isinstance(max_kv_len, int) or max_kv_len <= 0:
            return []
        from sparse_attn.kernels import never_skips   # lazily: the kernels import torch

        found = []
        for path, fits in self._curves():
            windowed = fits is not self.group.fits
            for phase in PHASES:
                scale = self.scale_factor(phase, windowed=windowed) if phase in fits else None
                if scale is not None and never_skips(scale, max_kv_len):
                    found.append((path, phase, scale))
        return found

    def effective_target(self, phase: str, override: float | None = None) -> float | None:
        """Target sparsity used for ``phase`` (override > checkpoint > default); None if no curve
        of the group calibrates it. Both curves share ``target_sparsity``."""
        check_phase(phase)
        if phase not in self.group.fits and phase not in (self.group.window_fits or {}):
            return None
        if override is not None:
            check_target(override, f"target_sparsity override for {phase}", "pass a value in [0, 1)")
            return float(override)
        return float(self.group.target_sparsity.get(phase, DEFAULT_TARGET_SPARSITY))

    def scale_factor(self, phase: str, target_sparsity: float | None = None, *, windowed: bool = False) -> float | None:
        """``threshold_scale_factor`` of ``phase`` (``a * exp(b * target)``) on the curve a layer uses
        (:meth:`curve`: ``windowed`` = a sliding-window layer); None = dense."""
        fits = self.curve(windowed)
        target = self.effective_target(phase, target_sparsity)
        if target is None or phase not in fits:
            return None
        return fits[phase].scale(target)

    def threshold(self, phase: str, kv_len: int, target_sparsity: float | None = None, *,
                  window: int | None = None) -> float | None:
        """The lambda serving uses for one sequence (``kernels.effective_lambda`` of the scale factor):
        ``a * exp(b * target) / kv_len``, or ``/ min(kv_len, window)`` on a sliding-window layer
        (``window`` tokens) when the group has the window curve; 0.0 where that is >= 1 (the sequence
        runs dense); None when ``phase`` has no curve (dense)."""
        from sparse_attn.kernels import effective_lambda   # lazily: the kernels import torch

        if isinstance(kv_len, bool) or not isinstance(kv_len, (int, float)) or not kv_len > 0:
            raise ValueError(f"kv_len must be a positive number of tokens, got {kv_len!r}")
        windowed = window is not None and self.has_window_curve
        scale = self.scale_factor(phase, target_sparsity, windowed=windowed)
        if scale is None:
            return None
        return effective_lambda(scale, kv_len, window if windowed else None)

    def matches(self, layer_name: str, class_name: str | Iterable[str] | None = None) -> bool:
        """Whether the layer gets skip-softmax (targeted and not ignored).

        ``class_name`` may be a single class name or several (e.g. the vLLM
        layer class and the HF-style module class that owns it); any match counts.
        """
        return group_matches(self.group.targets, self.group.ignore, layer_name, class_name)



    # -- serialisation ----------------------------------------------------- #
    def to_dict(self) -> dict[str, Any]:
        """Canonical section dict (per-group layout); ``parse(to_dict(c)) == c``."""
        g = self.group
        tsf = _curve_dict(g.formula, g.fits)
        group: dict[str, Any] = {"algorithm": "skip_softmax"}
        if g.targets:
            group["targets"] = list(g.targets)
        if g.ignore:
            group["ignore"] = list(g.ignore)
        group["threshold_scale_factor"] = tsf
        if g.window_fits is not None:
            group[WINDOW_CURVE_KEY] = _curve_dict(g.window_formula, g.window_fits)
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


def _curve_dict(formula: str, fits: Mapping[str, PhaseFit]) -> dict[str, Any]:
    """One curve as written: ``{formula, prefill: {a, b}, decode: {a, b}}`` (``log_a`` for the log formula)."""
    coef_names = SUPPORTED_FORMULAS[normalise_formula(formula)]
    out: dict[str, Any] = {"formula": formula}
    for phase in PHASES:
        if phase in fits:
            fit = fits[phase]
            out[phase] = {"log_a": math.log(fit.a), "b": fit.b} if coef_names[0] == "log_a" else {"a": fit.a, "b": fit.b}
    return out


#: What the absence of a known key means, for the near-miss warning.
_WITHOUT = {
    "targets": "every attention layer is targeted",
    "ignore": "no layer is ignored",
    "target_sparsity": f"each phase uses the default target {DEFAULT_TARGET_SPARSITY}",
    "target_sparse_ratio": f"each phase uses the default target {DEFAULT_TARGET_SPARSITY}",
    "threshold_scale_factor": "no phase is calibrated and both run dense",
    WINDOW_CURVE_KEY: "sliding-window layers use threshold_scale_factor divided by kv_len",
    "producer": "the section names no producer",
}


def _closest(key: Any, known: Iterable[str]) -> str | None:
    """The known key ``key`` is a near miss of (a typo or a case change), or None."""
    if not isinstance(key, str) or key in known or len(key) > 64:
        return None
    match = difflib.get_close_matches(key.lower(), sorted(known), n=1, cutoff=0.8)
    return match[0] if match else None


# --------------------------------------------------------------------------- #
# value checks (shared with the parser)
# --------------------------------------------------------------------------- #
def normalise_formula(formula: str) -> str:
    squashed = "".join(formula.split())
    for known in SUPPORTED_FORMULAS:
        if "".join(known.split()) == squashed:
            return known
    raise KeyError(formula)


def check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(value: Any, path: str, source: str | None, *, positive: bool = False) -> float:
    if not is_number(value):
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


def check_target(value: Any, path: str, fix: str, source: str | None = None) -> float:
    value = number(value, path, source)
    if not 0.0 <= value < 1.0:
        raise SparseAttentionConfigError(path, value, "a sparsity in [0, 1)", fix, source=source)
    return value


def algorithm_key(group: Any) -> str | None:
    """Which key of ``group`` names its algorithm (current ``algorithm``, legacy ``sparse_algo``)."""
    if isinstance(group, Mapping):
        for key in ("algorithm", "sparse_algo"):
            if key in group:
                return key
    return None


def group_algorithm(group: Any) -> Any:
    key = algorithm_key(group)
    return group[key] if key is not None else None


