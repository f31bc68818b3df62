"""The one registry of environment variables read by this project, and compat's own variables.

Modelled on vLLM's ``envs.py``: each variable is declared once, with its
default, its choices and its documentation, and is parsed once per process
(``reset_for_tests()`` clears the cache). docs/compat.md documents each of them in
a table that ``tests/compat/test_envs.py`` keeps in step with this registry.
An unset and an empty (or blank) variable both mean its default. Each
variable's ``choices`` text is built from the tuples its parser validates
against, and layout names come from ``compat.layouts.KVLayout``.

Declared here are the variables that steer compat's answers about vLLM (layout, cache writer,
CUDA-graph level). The product's own knobs (which CPU kernel, strict mode, the plugin switch,
calibration's counting mode, ...) are declared by ``sparse_attn.settings`` on this machinery and
join the registry with :func:`register`. compat never imports sparse_attn: a package that
declares variables names its module in the ``compat.envs`` entry-point group (``pyproject.toml``),
which :func:`variables` loads on first use, so ``python -m compat`` lists, validates and
spell-checks every variable even in a process that never imported that package.

Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from compat.errors import InvalidOverrideError
from compat.layouts import KVLayout

logger = logging.getLogger("compat")

#: Backends ``compat`` serves, by vLLM's ``AttentionBackendEnum`` member name.
BACKENDS: tuple[str, ...] = ("FLASHINFER", "FLASH_ATTN", "CPU_ATTN")
#: The backends whose layers run on the CPU (the others on a GPU).
CPU_BACKENDS: frozenset[str] = frozenset({"CPU_ATTN"})
#: Layout names of the catalogue: the ``compat.layouts.KVLayout`` values (one definition).
LAYOUT_NAMES: tuple[str, ...] = tuple(layout.value for layout in KVLayout)
WRITER_CHOICES: tuple[str, ...] = ("auto", "vllm", "adapter")
#: ``SPARSE_ATTN_CUDAGRAPH`` values (``compat.graphs.ENV_CAPS``).
CUDAGRAPH_CHOICES: tuple[str, ...] = ("auto", "decode", "never")
#: ``SPARSE_ATTN_CPU_PAGE_ISA`` values (``compat.model.readable_cpu_pages``).
CPU_PAGE_ISA_CHOICES: tuple[str, ...] = ("auto", "vllm")
#: Spellings ``parse_flag`` accepts.
FLAG_TRUE: tuple[str, ...] = ("1", "true", "yes", "on")
FLAG_FALSE: tuple[str, ...] = ("0", "false", "no", "off")
#: The prefix of every variable this project reads: an unknown name with it is a typo.
PREFIX = "SPARSE_ATTN_"
#: Longest excerpt of a variable's value a message quotes (values can be any length).
SHOWN_CHARS = 120
#: The entry-point group whose members declare more variables (each names a module that calls :func:`register`).
ENTRY_POINT_GROUP = "compat.envs"


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
        check_choice(var, raw, LAYOUT_NAMES)
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
        check_choice(var, backend, BACKENDS, what="backend")
        check_choice(var, layout, LAYOUT_NAMES)
        if backend in parsed:
            raise InvalidOverrideError(
                f"{var.name}={shown(raw)}: backend {cut(backend)} is given twice ({shown(parsed[backend])} and {shown(layout)}). "
                f"Expected each backend at most once. Fix: keep one {cut(backend)}=layout pair."
            )
        parsed[backend] = layout
    return parsed


def choice_parser(choices: tuple[str, ...]) -> Callable[[str, EnvVar], str]:
    """A parser taking one of ``choices`` (stripped, lower case)."""

    def parse(raw: str, var: EnvVar) -> str:
        value = raw.strip().lower()
        check_choice(var, value, choices)
        return value

    return parse


def parse_path(raw: str, var: EnvVar) -> str:
    """A path (stripped; ``""`` = the variable's documented default location)."""
    return raw.strip()


def _parse_module(raw: str, var: EnvVar) -> str:
    value = raw.strip()
    if value and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", value):
        raise InvalidOverrideError(
            f"{var.name}={shown(raw)} is not a module name", observed=shown(raw),
            expected="a dotted module name such as vllm._cpu_ops", fix=f"unset {var.name} or set it to a module name",
            vllm_version=None)
    return value


def parse_flag(raw: str, var: EnvVar) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False (any case), else :class:`InvalidOverrideError`."""
    value = raw.strip().lower()
    if value in FLAG_TRUE:
        return True
    if value in FLAG_FALSE:
        return False
    raise InvalidOverrideError(
        f"{var.name}={shown(raw)} is not a boolean. Expected one of {FLAG_TRUE + FLAG_FALSE}; "
        f"unset it or set {var.name}=1 / {var.name}=0."
    )


def parse_nonnegative_float(raw: str, var: EnvVar) -> float:
    """A number >= 0 (NaN refused)."""
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also rejects NaN
        raise InvalidOverrideError(
            f"{var.name}={shown(raw)} is not a number >= 0. Fix: set it to e.g. {var.default}, or unset it."
        )
    return value


def check_choice(var: EnvVar, value: str, choices: tuple[str, ...], what: str = "value") -> None:
    if value not in choices:
        raise InvalidOverrideError(
            f"{var.name}: {what} {shown(value)} is not valid. Valid {what}s: {', '.join(choices)}. "
            f"Fix: set {var.name} to one of them, or unset it for the default"
            + (f" ({var.default!r})." if var.default else " (let compat probe vLLM).")
        )


#: compat's own variables: each steers an answer about vLLM.
COMPAT_VARIABLES: tuple[EnvVar, ...] = (
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
        parse=choice_parser(WRITER_CHOICES),
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
        parse=choice_parser(CUDAGRAPH_CHOICES),
        choices=", ".join(CUDAGRAPH_CHOICES),
    ),
    EnvVar(
        name="SPARSE_ATTN_CPU_PAGE_ISA",
        default="auto",
        doc=(
            "CPU layers served sparse whose pages vLLM would pack for an ISA compat cannot read (`amx`: "
            "bfloat16 on a CPU with AMX): `auto` makes their metadata builder pick vLLM's `vec` / `vec16` "
            "pages instead (where the release lets compat choose: the builder picks the ISA, 0.32+), so "
            "they run sparse; `vllm` keeps vLLM's choice, and such layers stay native."
        ),
        parse=choice_parser(CPU_PAGE_ISA_CHOICES),
        choices=", ".join(CPU_PAGE_ISA_CHOICES),
    ),
    EnvVar(
        name="SPARSE_ATTN_CPU_OPS_MODULE",
        default="",
        doc=(
            "The vLLM module whose Python wrappers of the CPU attention ops (`cpu_attn_reshape_and_cache`, "
            "`cpu_attention_with_kv_cache`) tests and benchmarks call, instead of probing the candidates "
            "(`compat.probe.CPU_OPS_MODULES`); it must import and hold both."
        ),
        parse=_parse_module,
        choices="a dotted module name, e.g. vllm._cpu_ops",
    ),
)

#: Every registered variable by name: compat's, then each :func:`register` call's.
_registry: dict[str, EnvVar] = {var.name: var for var in COMPAT_VARIABLES}
_entry_points_loaded = False


def register(*variables: EnvVar) -> None:
    """Add ``variables`` to the registry (a package's own knobs, declared on this machinery).
    Registering the same declaration again is a no-op; another one under a taken name is an error."""
    for var in variables:
        if not var.name.startswith(PREFIX):
            raise ValueError(f"{var.name}: every variable of this project starts with {PREFIX}")
        known = _registry.get(var.name)
        if known is not None and known != var:
            raise ValueError(f"{var.name} is already registered with another declaration")
        _registry[var.name] = var


def _load_entry_points() -> None:
    """Import each module of the ``compat.envs`` entry-point group once (it registers its variables)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:  # a broken installation must not hide compat's own variables
            logger.warning("sparse-attn: the variables of %s (entry point %s) could not be loaded: %s: %s",
                           ep.value, ep.name, type(exc).__name__, exc)


def variables() -> dict[str, EnvVar]:
    """Every registered variable by name (compat's and those of the ``compat.envs`` entry points),
    in declaration order. The mapping is the registry itself: do not change it."""
    _load_entry_points()
    return _registry


_cache: dict[str, Any] = {}
_logged: set[str] = set()


def get(name: str) -> Any:
    """The parsed value of registered variable ``name`` (parsed once per process).

    Unset and empty (or blank) mean the same thing for every variable: its default.
    """
    if name not in _cache:
        var = _registry.get(name) or variables()[name]
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
    for name in variables():
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
    known = variables()
    found = {}
    for name in sorted(env):
        if name.upper().startswith(PREFIX) and name not in known:
            close = (difflib.get_close_matches(name.upper(), list(known), n=1, cutoff=0.6)
                     if len(name) < 128 else [])
            found[name] = close[0] if close else None
    return found


def unknown_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per unknown ``SPARSE_ATTN_*`` variable (see :func:`unknown`)."""
    return [
        f"{name[:80]} is not a variable sparse-attn reads, so it has no effect"
        + (f"; did you mean {close}?" if close else f" (known: {', '.join(variables())})")
        + (" Variable names are case-sensitive." if not name.startswith(PREFIX) else "")
        for name, close in unknown(environ).items()
    ]


def overrides() -> dict[str, str]:
    """The registered variables set in the environment, as raw strings."""
    return {name: os.environ[name] for name in variables() if name in os.environ}


def reset_for_tests() -> None:
    """Forget parsed values so a test's ``monkeypatch.setenv`` takes effect."""
    _cache.clear()
    _logged.clear()


def without_ours(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default ``os.environ``) without any ``SPARSE_ATTN_*`` variable: the
    environment of a process that must start from this project's defaults (a native reference engine,
    a server whose variables the caller sets itself, a test's subprocess)."""
    env = os.environ if environ is None else environ
    return {name: value for name, value in env.items() if not name.startswith(PREFIX)}
