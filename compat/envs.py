"""The one registry of environment variables read by this project.

Modelled on vLLM's ``envs.py``: each variable is declared once, with its
default, its choices and its documentation, and is parsed once per process
(``reset_for_tests()`` clears the cache). docs/compat.md documents each of them in
a table that ``tests/compat/test_envs.py`` keeps in step with this registry.
An unset and an empty (or blank) variable both mean its default. Each
variable's ``choices`` text is built from the tuples its parser validates
against, and layout names come from ``compat.layouts.KVLayout``.

Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from compat.errors import InvalidOverrideError
from compat.layouts import KVLayout

logger = logging.getLogger("compat")

#: Backends ``compat`` serves, by vLLM's ``AttentionBackendEnum`` member name.
BACKENDS: tuple[str, ...] = ("FLASHINFER", "FLASH_ATTN", "CPU_ATTN")
#: Layout names of the catalogue: the ``compat.layouts.KVLayout`` values (one definition).
LAYOUT_NAMES: tuple[str, ...] = tuple(layout.value for layout in KVLayout)
WRITER_CHOICES: tuple[str, ...] = ("auto", "vllm", "adapter")
#: ``SPARSE_ATTN_CUDAGRAPH`` values (``compat.graphs.ENV_CAPS``).
CUDAGRAPH_CHOICES: tuple[str, ...] = ("auto", "decode", "never")
#: ``SPARSE_ATTN_CPU_KERNEL`` values (``sparse_attn.kernels.api.cpu_kernel`` applies them).
CPU_KERNEL_CHOICES: tuple[str, ...] = ("auto", "compiled", "torch")
#: Spellings ``_parse_flag`` accepts.
FLAG_TRUE: tuple[str, ...] = ("1", "true", "yes", "on")
FLAG_FALSE: tuple[str, ...] = ("0", "false", "no", "off")
#: The prefix of every variable this project reads: an unknown name with it is a typo.
PREFIX = "SPARSE_ATTN_"
#: Longest excerpt of a variable's value a message quotes (values can be any length).
SHOWN_CHARS = 120


def shown(raw: str) -> str:
    """``repr(raw)`` cut to ``SHOWN_CHARS``, naming the full length when cut."""
    if len(raw) <= SHOWN_CHARS:
        return repr(raw)
    return f"{raw[:SHOWN_CHARS]!r}... ({len(raw)} characters)"


def cut(raw: str) -> str:
    """``raw`` cut to ``SHOWN_CHARS``, naming the full length when cut."""
    return raw if len(raw) <= SHOWN_CHARS else f"{raw[:SHOWN_CHARS]}... ({len(raw)} characters)"


@dataclass(frozen=True)
class EnvVar:
    """One documented environment variable."""

    name: str
    default: str
    doc: str
    #: ``parse(raw, var)``: raw is the variable's value, or ``default`` when it is unset or empty
    parse: Callable[[str, "EnvVar"], Any]
    #: what values are valid, for ``python -m compat`` and docs/compat.md (built from the
    #: validation tuples above, never typed a second time)
    choices: str
    #: set by the project's own drivers for the processes they start, not by users
    internal: bool = False


def _parse_layout_override(raw: str, var: EnvVar) -> Mapping[str, str]:
    """``"packed"`` -> every backend; ``"FLASHINFER=packed,CPU_ATTN=cpu-packed"`` -> per backend."""
    raw = raw.strip()
    if not raw:  # the default: no override
        return {}
    if "=" not in raw:
        _check_choice(var, raw, LAYOUT_NAMES)
        return {backend: raw for backend in BACKENDS}
    parsed: dict[str, str] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        backend, sep, layout = (part.strip() for part in item.partition("="))
        if not sep:
            raise InvalidOverrideError(
                f"{var.name}={shown(raw)}: item {shown(item)} is not BACKEND=layout. "
                f"Expected one layout name for every backend, or BACKEND=layout pairs "
                f"separated by commas, e.g. {var.name}=FLASHINFER=packed,CPU_ATTN=cpu-packed. "
                f"Valid: {var.choices}."
            )
        _check_choice(var, backend, BACKENDS, what="backend")
        _check_choice(var, layout, LAYOUT_NAMES)
        if backend in parsed:
            raise InvalidOverrideError(
                f"{var.name}={shown(raw)}: backend {cut(backend)} is given twice ({shown(parsed[backend])} and {shown(layout)}). "
                f"Expected each backend at most once. Fix: keep one {cut(backend)}=layout pair."
            )
        parsed[backend] = layout
    return parsed


def _parse_writer(raw: str, var: EnvVar) -> str:
    value = raw.strip().lower()
    _check_choice(var, value, WRITER_CHOICES)
    return value


def _parse_cudagraph(raw: str, var: EnvVar) -> str:
    value = raw.strip().lower()
    _check_choice(var, value, CUDAGRAPH_CHOICES)
    return value


def _parse_cpu_kernel(raw: str, var: EnvVar) -> str:
    value = raw.strip().lower()
    _check_choice(var, value, CPU_KERNEL_CHOICES)
    return value


def _parse_path(raw: str, var: EnvVar) -> str:
    return raw.strip()


def _parse_flag(raw: str, var: EnvVar) -> bool:
    value = raw.strip().lower()
    if value in FLAG_TRUE:
        return True
    if value in FLAG_FALSE:
        return False
    raise InvalidOverrideError(
        f"{var.name}={shown(raw)} is not a boolean. Expected one of {FLAG_TRUE + FLAG_FALSE}; "
        f"unset it or set {var.name}=1 / {var.name}=0."
    )


def _parse_nonnegative_float(raw: str, var: EnvVar) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also rejects NaN
        raise InvalidOverrideError(
            f"{var.name}={shown(raw)} is not a number >= 0. Fix: set it to e.g. {var.default}, or unset it."
        )
    return value


def _parse_scale_list(raw: str, var: EnvVar) -> tuple[float, ...] | None:
    """``""`` -> None; ``"[0.1, 2.5]"`` -> ``(0.1, 2.5)``: a JSON list of finite numbers > 0."""
    if not raw.strip():
        return None
    try:
        values = json.loads(raw)
        ok = isinstance(values, list) and bool(values) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the parser's ~1000 levels
        ok = False
    if not ok:
        raise InvalidOverrideError(
            f"{var.name} is not a JSON list of numbers > 0", observed=shown(raw), expected=var.choices,
            fix=f"unset {var.name}: `sparse-attn calibrate` sets it for the engine it starts",
        )
    return tuple(float(v) for v in values)


def _check_choice(var: EnvVar, value: str, choices: tuple[str, ...], what: str = "value") -> None:
    if value not in choices:
        raise InvalidOverrideError(
            f"{var.name}: {what} {shown(value)} is not valid. Valid {what}s: {', '.join(choices)}. "
            f"Fix: set {var.name} to one of them, or unset it for the default"
            + (f" ({var.default!r})." if var.default else " (let compat probe vLLM).")
        )


REGISTRY: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar(
            name="SPARSE_ATTN_KV_LAYOUT",
            default="",
            doc=(
                "Force the KV-cache layout instead of probing vLLM: one layout for every backend, "
                "or `BACKEND=layout` pairs separated by commas."
            ),
            parse=_parse_layout_override,
            choices=f"{', '.join(LAYOUT_NAMES)}; backends {', '.join(BACKENDS)}",
        ),
        EnvVar(
            name="SPARSE_ATTN_CACHE_WRITER",
            default="auto",
            doc=(
                "Who stores new K/V tokens in the cache: `vllm` (its `do_kv_cache_update` runs before "
                "`forward`), `adapter` (the sparse forward path writes), or `auto` (probe the backend's "
                "`forward_includes_kv_cache_update`)."
            ),
            parse=_parse_writer,
            choices=", ".join(WRITER_CHOICES),
        ),
        EnvVar(
            name="SPARSE_ATTN_CUDAGRAPH",
            default="auto",
            doc=(
                "CUDA-graph level the builders of sparse backends declare to vLLM: `auto` and `decode` declare "
                "min(native, UNIFORM_SINGLE_TOKEN_DECODE) (decode batches captured, prefill and mixed batches "
                "piecewise with eager attention; `decode` pins it should `auto` change); `never` declares NEVER "
                "(vLLM drops full graphs, keeps piecewise)."
            ),
            parse=_parse_cudagraph,
            choices=", ".join(CUDAGRAPH_CHOICES),
        ),
        EnvVar(
            name="SPARSE_ATTN_CPU_KERNEL",
            default="auto",
            doc=(
                "Which skip-softmax kernel serves CPU tensors: `compiled` (the C++ kernel, compiled on first use; "
                "a failed build is an error), `torch` (the pure-torch kernel), or `auto` (the compiled kernel when it "
                "builds here, else the torch kernel with one warning line)."
            ),
            parse=_parse_cpu_kernel,
            choices=", ".join(CPU_KERNEL_CHOICES),
        ),
        EnvVar(
            name="SPARSE_ATTN_CPU_KERNEL_CACHE",
            default="",
            doc=(
                "Directory of the compiled CPU kernel's build cache (one library per source hash, torch version "
                "and ISA); default `$XDG_CACHE_HOME/sparse-attn`, i.e. `~/.cache/sparse-attn`."
            ),
            parse=_parse_path,
            choices="a directory path",
        ),
        EnvVar(
            name="SPARSE_ATTN_DISABLE",
            default="0",
            doc="`1` turns the vLLM plugin off: every worker stays on native vLLM attention.",
            parse=_parse_flag,
            choices=", ".join(FLAG_FALSE[:1] + FLAG_TRUE[:1]),
        ),
        EnvVar(
            name="SPARSE_ATTN_STRICT",
            default="0",
            doc="`1` makes any attention layer the sparse kernel cannot serve a start-up error instead of a native fallback.",
            parse=_parse_flag,
            choices=", ".join(FLAG_FALSE[:1] + FLAG_TRUE[:1]),
        ),
        EnvVar(
            name="SPARSE_ATTN_STATS_INTERVAL_S",
            default="60",
            doc="Seconds between the plugin's achieved-sparsity log lines in each worker; `0` turns them off.",
            parse=_parse_nonnegative_float,
            choices="a number >= 0",
        ),
        EnvVar(
            name="SPARSE_ATTN_CALIBRATION_SCALES",
            default="",
            doc=(
                "Internal: set by `sparse-attn calibrate` for the engine it starts. A JSON list of candidate "
                "scale factors; workers then count skippable tiles per candidate and keep outputs dense."
            ),
            parse=_parse_scale_list,
            choices="a JSON list of numbers > 0, e.g. [0.01, 0.5, 12.0]",
            internal=True,
        ),
        EnvVar(
            name="SPARSE_ATTN_PRUNE_PASSED_ENVS",
            default="0",
            doc=(
                "Developer / CI only, read by `tools/prune_env.py` (not by the plugin): `1` removes each tox env "
                "once its tests passed, which keeps the 19-env matrix within disk; `.ci/run` sets it."
            ),
            parse=_parse_flag,
            choices=", ".join(FLAG_FALSE[:1] + FLAG_TRUE[:1]),
            internal=True,
        ),
    )
}


_cache: dict[str, Any] = {}
_logged: set[str] = set()


def get(name: str) -> Any:
    """The parsed value of registered variable ``name`` (parsed once per process).

    Unset and empty (or blank) mean the same thing for every variable: its default.
    """
    if name not in _cache:
        var = REGISTRY[name]
        raw = os.environ.get(name)
        given = raw is not None and raw.strip() != ""
        value = var.parse(raw if given else var.default, var)
        if given and raw.strip() != var.default and not var.internal and name not in _logged:
            _logged.add(name)
            logger.info("sparse-attn: override %s=%s applied", name, cut(raw))
        _cache[name] = value
    return _cache[name]


def validate_all() -> dict[str, str]:
    """Parse every registered variable; ``{name: error message}`` for each invalid one."""
    errors = {}
    for name in REGISTRY:
        try:
            get(name)
        except InvalidOverrideError as exc:
            errors[name] = str(exc)
    return errors


def unknown(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """``{name: closest registered name or None}`` for each ``SPARSE_ATTN_*`` variable set in
    ``environ`` (default ``os.environ``) that is not in the registry: a typo such as
    ``SPARSE_ATTN_DISABLED`` would otherwise be ignored without a word. The prefix is matched in any
    case (environment names are case-sensitive, so ``sparse_attn_disable=1`` is ignored too)."""
    import difflib

    env = os.environ if environ is None else environ
    found = {}
    for name in sorted(env):
        if name.upper().startswith(PREFIX) and name not in REGISTRY:
            close = (difflib.get_close_matches(name.upper(), list(REGISTRY), n=1, cutoff=0.6)
                     if len(name) < 128 else [])
            found[name] = close[0] if close else None
    return found


def unknown_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per unknown ``SPARSE_ATTN_*`` variable (see :func:`unknown`)."""
    return [
        f"{name[:80]} is not a variable sparse-attn reads, so it has no effect"
        + (f"; did you mean {close}?" if close else f" (known: {', '.join(REGISTRY)})")
        + (" Variable names are case-sensitive." if not name.startswith(PREFIX) else "")
        for name, close in unknown(environ).items()
    ]


def overrides() -> dict[str, str]:
    """The registered variables set in the environment, as raw strings."""
    return {name: os.environ[name] for name in REGISTRY if name in os.environ}


def reset_for_tests() -> None:
    """Forget parsed values so a test's ``monkeypatch.setenv`` takes effect."""
    _cache.clear()
    _logged.clear()
