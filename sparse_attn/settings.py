"""The product's own environment variables: which CPU kernel serves, where it is cached, the plugin
switch, strict mode, the stats log interval and calibration's counting mode.

Declared on ``compat.envs``' machinery (one registry, parsed once per process, the same refusal
messages, ``python -m compat`` and the README table list them beside compat's own), but owned
here: they are decisions of this product, not facts about vLLM. ``compat`` knows them only
through the ``compat.envs`` entry point in ``pyproject.toml``; importing this module registers
them. The kernels read their knobs from here and import nothing else of the project.
"""

from __future__ import annotations

import json
import math
from typing import Any

from compat.envs import (
    FLAG_FALSE,
    FLAG_TRUE,
    EnvVar,
    choice_parser,
    parse_flag,
    parse_nonnegative_float,
    parse_path,
    register,
    shown,
)
from compat.envs import get as _get
from compat.errors import InvalidOverrideError
from sparse_attn.protocol import CALIBRATION_ENV

__all__ = ["CPU_ISA_CHOICES", "CPU_KERNEL_CHOICES", "DENSE_STEPS_CHOICES", "VARIABLES", "get"]

#: ``SPARSE_ATTN_CPU_KERNEL`` values (``sparse_attn.kernels.cpu_impl.cpu_kernel`` applies them).
CPU_KERNEL_CHOICES: tuple[str, ...] = ("auto", "compiled", "torch")
#: ``SPARSE_ATTN_CPU_ISA`` values (``sparse_attn.kernels.cpu_build.cpu_isa`` applies them).
CPU_ISA_CHOICES: tuple[str, ...] = ("auto", "amx", "avx512bf16", "avx512", "avx2", "generic")
#: ``SPARSE_ATTN_DENSE_STEPS`` values (``sparse_attn.plugin.dense_steps`` applies them).
DENSE_STEPS_CHOICES: tuple[str, ...] = ("auto", "native", "own")
_FLAG_CHOICES = ", ".join(FLAG_FALSE[:1] + FLAG_TRUE[:1])


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


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        name="SPARSE_ATTN_CPU_KERNEL",
        default="auto",
        doc=(
            "Which skip-softmax kernel serves CPU tensors: `compiled` (the C++ kernel, compiled on first use; "
            "a failed build is an error), `torch` (the pure-torch kernel), or `auto` (the compiled kernel when it "
            "builds here, else the torch kernel with one warning line)."
        ),
        parse=choice_parser(CPU_KERNEL_CHOICES),
        choices=", ".join(CPU_KERNEL_CHOICES),
    ),
    EnvVar(
        name="SPARSE_ATTN_CPU_ISA",
        default="auto",
        doc=(
            "Which instruction set the compiled CPU kernel is built for: `amx` (`avx512bf16` with AMX-BF16 tiles for "
            "a bf16 cache's prefill, as vLLM's own bf16 attention on such CPUs), `avx512bf16` (`avx512` plus "
            "AVX512-BF16 pair dot products for a bf16 cache's prefill), `avx512` (512-bit matrix micro-kernels, "
            "outputs bit-identical to `avx2`), `avx2` (AVX2 + FMA + F16C), `generic` (portable vector code), or "
            "`auto` (the widest this CPU runs). Pin `avx2` where 512-bit code lowers the clock; an ISA the CPU "
            "lacks is refused."
        ),
        parse=choice_parser(CPU_ISA_CHOICES),
        choices=", ".join(CPU_ISA_CHOICES),
    ),
    EnvVar(
        name="SPARSE_ATTN_CPU_KERNEL_CACHE",
        default="",
        doc=(
            "Directory of the compiled CPU kernel's build cache (one library per source hash, torch version "
            "and ISA); default `$XDG_CACHE_HOME/sparse-attn`, i.e. `~/.cache/sparse-attn`."
        ),
        parse=parse_path,
        choices="a directory path",
    ),
    EnvVar(
        name="SPARSE_ATTN_DENSE_STEPS",
        default="auto",
        doc=(
            "Which attention serves a prefill or mixed step of a sparse layer in which no sequence can skip "
            "(lambda 0: a prompt too short for the curve, or a window curve that never skips at its target): "
            "`native` (vLLM's own impl), `own` (the plugin's kernel with the rule off), or `auto`: `own` where "
            "the compiled CPU kernel runs a bf16 cache's prefill on bf16 pair products (its dense prefill is "
            "1.8-2.1x vLLM's CPU kernel there), `native` elsewhere. Decode steps always run the plugin's kernel "
            "(a captured graph cannot switch kernels per step)."
        ),
        parse=choice_parser(DENSE_STEPS_CHOICES),
        choices=", ".join(DENSE_STEPS_CHOICES),
    ),
    EnvVar(
        name="SPARSE_ATTN_DISABLE",
        default="0",
        doc="`1` turns the vLLM plugin off: every worker stays on native vLLM attention.",
        parse=parse_flag,
        choices=_FLAG_CHOICES,
    ),
    EnvVar(
        name="SPARSE_ATTN_STRICT",
        default="0",
        doc="`1` makes any attention layer the sparse kernel cannot serve a start-up error instead of a native fallback.",
        parse=parse_flag,
        choices=_FLAG_CHOICES,
    ),
    EnvVar(
        name="SPARSE_ATTN_CHECK_EVERY_LAUNCH",
        default="0",
        doc=(
            "Debugging: `1` validates every kernel argument at every eager (prefill / mixed) launch; by "
            "default the first launch of each step's plan validates and the other layers reuse it."
        ),
        parse=parse_flag,
        choices=_FLAG_CHOICES,
    ),
    EnvVar(
        name="SPARSE_ATTN_STATS_INTERVAL_S",
        default="60",
        doc="Seconds between the plugin's achieved-sparsity log lines in each worker; `0` turns them off.",
        parse=parse_nonnegative_float,
        choices="a number >= 0",
    ),
    EnvVar(
        name=CALIBRATION_ENV,
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
            "once its tests passed, which keeps the 20-env matrix within disk; `.ci/run` sets it."
        ),
        parse=parse_flag,
        choices=_FLAG_CHOICES,
        internal=True,
    ),
)
register(*VARIABLES)
_NAMES = frozenset(var.name for var in VARIABLES)


def get(name: str) -> Any:
    """The parsed value of the product variable ``name`` (one of :data:`VARIABLES`; compat's own
    variables are compat's to read), parsed once per process like every registered variable."""
    if name not in _NAMES:
        raise KeyError(f"{name} is not one of sparse_attn.settings' variables ({', '.join(sorted(_NAMES))})")
    return _get(name)
