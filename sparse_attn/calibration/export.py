"""Build the ``sparse_attention_config`` section and write it atomically.

* :func:`build_sparse_attention_config` - the one writer of the format: a
  :class:`~sparse_attn.config.SparseAttentionConfig` built from per-phase fits,
  targets and producer info, serialised by its ``to_dict()`` and validated by
  parsing it back with :func:`sparse_attn.config.parse_sparse_attention_config`.
* :func:`write_json_atomic` - the ``--output`` artifact.
* :func:`update_checkpoint_config` - merge the section into ``CKPT/config.json``;
  :func:`check_checkpoint_update` is its read-only pre-flight (run before vLLM
  starts, so a section we would refuse does not waste a calibration) and
  :func:`merge_section` the merge itself.

Merging: the key ``sparse_attention_config`` is shared (MiniMax-M3 keeps its
own sparse attention settings there), so a section that is not ModelOpt /
TensorRT-LLM metadata (:func:`sparse_attn.config.is_modelopt_section`) is
refused, never overwritten. In a ModelOpt section only the skip-softmax
group's calibration is replaced; every other group (e.g. ModelOpt's N:M
``sparse_softmax``) and every key we do not interpret is kept verbatim.

Atomicity: content goes to a temporary file in the *same directory*, is
flushed and fsync'ed, then ``os.replace``-d over the destination and the
directory is fsync'ed. A reader (or a crash/kill at any point) sees either
the old file or the new one, never a torn mix; on any failure the temporary
file is removed and the original is left untouched.

Temporary files are named ``.<name>.sparse-attn-<pid>.<random>.tmp``, so a
process killed with SIGKILL (which no ``finally`` survives) leaves litter that
can be recognised and attributed: :func:`remove_stale_temp_files` deletes the
ones whose process is gone, and every write (and ``sparse-attn calibrate`` at
start) calls it for the directory it writes into.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Mapping

from ..config import (
    DEFAULT_FORMULA,
    PHASES,
    SECTION_KEY,
    PhaseFit,
    Producer,
    SkipSoftmaxGroup,
    SparseAttentionConfig,
    SparseAttentionConfigError,
    is_modelopt_section,
    parse_sparse_attention_config,
    read_config_json,
    read_section,
)
from .errors import CalibrationError
from .fit import FitResult

__all__ = [
    "PRODUCER_NAME",
    "ExportError",
    "build_sparse_attention_config",
    "check_checkpoint_update",
    "merge_section",
    "remove_stale_temp_files",
    "update_checkpoint_config",
    "write_json_atomic",
    "write_text_atomic",
]

PRODUCER_NAME = "sparse-attn"


class ExportError(CalibrationError):
    """The calibration result cannot be written where it was asked to go."""


def _package_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version("sparse-attn")
    except PackageNotFoundError:  # running from a source tree that is not installed
        import sparse_attn

        v = getattr(sparse_attn, "__version__", None)
        return v if isinstance(v, str) else None


def _coefficients(fit: FitResult | PhaseFit | Mapping[str, float] | tuple[float, float]) -> dict[str, float]:
    if isinstance(fit, (FitResult, PhaseFit)):
        return {"a": float(fit.a), "b": float(fit.b)}
    if isinstance(fit, Mapping):
        return {"a": float(fit["a"]), "b": float(fit["b"])}
    a, b = fit
    return {"a": float(a), "b": float(b)}


def build_sparse_attention_config(
    fits: Mapping[str, FitResult | PhaseFit | Mapping[str, float] | tuple[float, float]],
    targets: Mapping[str, float] | None = None,
    *,
    target_classes: list[str] | tuple[str, ...] | None = None,
    ignore: list[str] | tuple[str, ...] | None = None,
    producer_name: str = PRODUCER_NAME,
    producer_version: str | None = None,
    group_name: str = "group_0",
    window_fits: Mapping[str, FitResult | PhaseFit | Mapping[str, float] | tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """The ``sparse_attention_config`` section for ``fits`` (phase -> fit), plus the sliding-window
    layers' own curve ``window_fits`` (``WINDOW_CURVE_KEY``: ``lambda = scale / min(kv_len, w)``;
    None = not written, so windowed layers use ``fits`` with ``scale / kv_len``).

    The one writer of the format: it builds a :class:`SparseAttentionConfig`
    and returns its ``to_dict()``, then parses that back with the runtime's
    parser, so a bad value raises ``SparseAttentionConfigError`` here rather
    than at serve time. ``targets`` defaults to each ``FitResult.target_sparsity``.
    Phases absent from ``fits`` are omitted (they run dense). ``producer_version``
    defaults to the installed sparse-attn version.
    """
    if not fits:
        raise ExportError("no phase was calibrated; nothing to export (calibrate at least prefill or decode)")
    unknown = [p for p in (*fits, *(window_fits or {})) if p not in PHASES]
    if unknown:
        raise ExportError(f"unknown phase(s) {unknown}; expected {list(PHASES)}")
    targets = dict(targets or {})
    for phase, fit in (*(window_fits or {}).items(), *fits.items()):
        if phase not in targets and isinstance(fit, FitResult):
            targets[phase] = fit.target_sparsity
    coefficients = {p: _coefficients(fits[p]) for p in PHASES if p in fits}
    window_coefficients = None if window_fits is None else {p: _coefficients(window_fits[p]) for p in PHASES if p in window_fits}
    config = SparseAttentionConfig(
        group=SkipSoftmaxGroup(
            name=group_name,
            targets=tuple(sorted(set(target_classes or ()))),
            ignore=tuple(ignore or ()),
            formula=DEFAULT_FORMULA,
            fits={p: PhaseFit(a=c["a"], b=c["b"]) for p, c in coefficients.items()},
            window_fits=None if window_coefficients is None else
            {p: PhaseFit(a=c["a"], b=c["b"]) for p, c in window_coefficients.items()},
            target_sparsity={p: float(targets[p]) for p in PHASES if p in targets and (p in fits or p in (window_fits or {}))},
        ),
        producer=Producer(name=producer_name, version=producer_version if producer_version is not None else _package_version()),
    )
    section = config.to_dict()
    parse_sparse_attention_config(section, source="calibration result")  # validate
    return section


# --------------------------------------------------------------------------- #
# atomic writes
# --------------------------------------------------------------------------- #
def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: Marks our temporary files; the pid after it names the process that made one.
TEMP_TAG = "sparse-attn"
_TEMP_NAME = re.compile(r"^\..+\." + re.escape(TEMP_TAG) + r"-(?P<pid>[0-9]+)\.[^./]+\.tmp$")


#: Above every pid a kernel hands out (Linux caps pid_max at 2**22): a name with a larger
#: "pid" was not made by this module, so it is left alone (and os.kill would overflow on it).
MAX_PID = 1 << 22


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    except OSError:
        return True  # cannot tell: keep the file
    return True


def remove_stale_temp_files(directory: str | Path) -> list[Path]:
    """Delete temporary files that a killed sparse-attn process left in ``directory``.

    Only names this module creates (``.<name>.sparse-attn-<pid>.<random>.tmp``) whose
    ``pid`` is no longer running are removed; anything else is left alone, including
    the in-flight temp files of a live process. Returns the paths removed.
    """
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None or len(match["pid"]) > 8 or int(match["pid"]) > MAX_PID or _pid_alive(int(match["pid"])):
            continue
        if not entry.is_file() or entry.is_symlink():  # ours are regular files; leave anything else alone
            continue
        try:
            entry.unlink()
        except FileNotFoundError:
            continue
        except OSError:
            continue  # not ours to force (permissions); leave it
        removed.append(entry)
    return removed


def write_text_atomic(path: str | Path, text: str, *, mode: int | None = None) -> Path:
    """Replace ``path`` with ``text`` atomically (temp file in the same dir, fsync, rename, fsync dir).

    ``mode`` defaults to the existing file's permission bits, or 0o644 masked
    by the umask for a new file. Raises :class:`ExportError` with the reason.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise ExportError(f"cannot write {path}: directory {directory} does not exist. Fix: create it or choose another path")
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o644 & ~umask
    remove_stale_temp_files(directory)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.{TEMP_TAG}-{os.getpid()}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise ExportError(
            f"cannot write {path}: directory {directory} is not writable ({exc.strerror or exc}). "
            f"Fix: run with write permission there, or write with --output elsewhere and merge later"
        ) from exc
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise ExportError(f"cannot write {path}: {exc.strerror or exc}; the original file was left unchanged") from exc
        raise
    _fsync_dir(directory)
    return path


def _dumps(obj: Any) -> str:
    try:
        return json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    except ValueError as exc:
        raise ExportError(f"refusing to write non-finite numbers to JSON ({exc}); the fit is invalid") from exc


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically (the ``--output`` artifact)."""
    return write_text_atomic(path, _dumps(obj))


def _merge_refusal(cfg_path: Path, seen: str, expected: str) -> ExportError:
    return ExportError(
        f"refusing to update {cfg_path}: its {SECTION_KEY} is {seen}; expected {expected}. "
        f"Fix: drop --update_checkpoint_config and merge the report written with --output into config.json by hand "
        f"(or copy the checkpoint and remove the section from the copy first)"
    )


def merge_section(existing: Any, new: Mapping[str, Any], *, source: str = "config.json") -> dict[str, Any]:
    """The section to write when ``existing`` (the current value, None when absent) meets ``new``
    (one skip-softmax group, as :func:`build_sparse_attention_config` returns).

    * absent: ``new``.
    * not ModelOpt-shaped (MiniMax-M3's ``{"use_sparse_attention": true, ...}``,
      a string, ...): :class:`ExportError`; it is the model's own setting.
    * ModelOpt metadata without a skip-softmax group (e.g. only an N:M group):
      every existing key kept verbatim, ``new``'s group added under a free name
      after the others, ``producer`` set to ours.
    * ModelOpt metadata with a skip-softmax group: that group keeps its name,
      position, ``targets``/``ignore`` and unknown keys; its formula, curve and
      ``target_sparsity`` become ``new``'s; other groups and unknown section
      keys are kept verbatim; ``producer`` becomes ours (it names who made the
      calibration that is now in the section). Legacy top-level
      ``threshold_scale_factor`` / ``target_sparse_ratio`` belonged to the old
      skip-softmax calibration and are dropped with it (left in place they
      would shadow nothing but mislead a reader).
    * a malformed skip-softmax group: :class:`ExportError` (we cannot tell what
      of it to keep).
    """
    cfg_path = Path(source)
    try:
        fresh = parse_sparse_attention_config(new, source="section to export")
    except SparseAttentionConfigError as exc:
        raise ExportError(f"refusing to write an invalid section into {cfg_path}: {exc}") from exc
    if existing is None:
        return json.loads(json.dumps(dict(new)))
    if not is_modelopt_section(existing):
        if isinstance(existing, Mapping):
            keys = ", ".join(sorted(map(str, existing))[:6]) or "none"
            seen = f"an object with keys {keys}, not ModelOpt metadata (the model's own settings, as MiniMax-M3 keeps there)"
        else:
            seen = f"a JSON {type(existing).__name__}, not ModelOpt metadata"
        raise _merge_refusal(cfg_path, seen, "absent, or ModelOpt / TensorRT-LLM metadata (config_groups whose groups carry an algorithm)")
    try:
        current = read_section(existing, source=str(cfg_path)).config
    except SparseAttentionConfigError as exc:
        raise _merge_refusal(cfg_path, f"ModelOpt metadata with a malformed skip-softmax group ({exc})",
                             "a valid skip-softmax group to replace") from None
    if current is None:
        # No skip-softmax group yet: add ours beside the others, touching nothing else.
        merged = copy.deepcopy(dict(existing))
        groups = merged["config_groups"]
        name, number = fresh.group.name, 0
        while name in groups:
            number += 1
            name = f"group_{number}"
        groups[name] = next(iter(new["config_groups"].values()))
        if "producer" in new:
            merged["producer"] = new["producer"]
        return json.loads(json.dumps(merged))
    group = dataclasses.replace(
        fresh.group,
        name=current.group.name,
        # Which layers are sparse is the checkpoint's decision (ModelOpt's export, or the
        # user's edit), not calibration's: calibration counts every attention layer and
        # only reports the classes it found (``targets``) and never decides an ``ignore``
        # list. So the existing lists win; calibration's fill in only where the existing
        # group had none (``targets`` absent means every attention layer, as ours does).
        targets=current.group.targets or fresh.group.targets,
        ignore=current.group.ignore or fresh.group.ignore,
        extra=current.group.extra,
    )
    merged_cfg = dataclasses.replace(current, group=group, producer=fresh.producer or current.producer)
    return json.loads(json.dumps(merged_cfg.to_dict()))


def _read_checkpoint_config(ckpt: Path) -> tuple[Path, dict[str, Any]]:
    cfg_path = ckpt / "config.json"
    if not ckpt.is_dir():
        raise ExportError(f"checkpoint directory {ckpt} does not exist. Fix: pass the model directory that holds config.json")
    if not os.path.lexists(cfg_path):
        raise ExportError(
            f"{cfg_path} does not exist; refusing to create a config.json from scratch. "
            f"Fix: pass a Hugging Face checkpoint directory, or use --output to write the section on its own"
        )
    try:
        return cfg_path, read_config_json(ckpt)  # the one reader: non-blocking, bounded, strict UTF-8 JSON
    except SparseAttentionConfigError as exc:
        top_level = exc.path == "config.json" and exc.expected == "a JSON object at the top level"
        seen = f"{cfg_path} holds a JSON {exc.value}, not an object" if top_level else str(exc)
        raise ExportError(f"{seen}; refusing to overwrite it. Fix: repair or restore config.json first") from None


def _require_writable(ckpt: Path) -> None:
    if not os.access(ckpt, os.W_OK):
        raise ExportError(
            f"checkpoint directory {ckpt} is not writable. Fix: run with write permission, copy the checkpoint, "
            f"or write the section with --output and merge it later"
        )


def check_checkpoint_update(ckpt_dir: str | Path) -> None:
    """Raise :class:`ExportError` if :func:`update_checkpoint_config` would refuse ``ckpt_dir``
    for a reason known before calibrating (config.json missing or not an object, a foreign or
    malformed ``sparse_attention_config``, an unwritable directory). Reads only; writes nothing."""
    ckpt = Path(ckpt_dir)
    cfg_path, data = _read_checkpoint_config(ckpt)
    # The merge itself, against a stand-in for the section calibration will produce: whatever
    # it refuses now (foreign or malformed section) it would refuse after calibrating.
    merge_section(data.get(SECTION_KEY), _PROBE_SECTION, source=str(cfg_path))
    _require_writable(ckpt)


#: A valid one-group section, only for :func:`check_checkpoint_update` to reach the refusals.
_PROBE_SECTION: Mapping[str, Any] = {
    "config_groups": {"group_0": {"algorithm": "skip_softmax", "threshold_scale_factor": {
        "formula": DEFAULT_FORMULA, "prefill": {"a": 1.0, "b": 1.0}}}},
}


def update_checkpoint_config(ckpt_dir: str | Path, section: Mapping[str, Any]) -> Path:
    """Merge ``section`` into ``sparse_attention_config`` of ``ckpt_dir/config.json`` atomically.

    Every other key of config.json is preserved, in its original order (an
    existing section stays in its slot; a new one is appended). The section
    itself is merged by :func:`merge_section`: a foreign section (not ModelOpt
    metadata) is refused and the file left byte-identical; in a ModelOpt
    section only the skip-softmax calibration is replaced. Refuses with
    :class:`ExportError` when config.json is missing, not valid JSON, not an
    object, or the directory is not writable. ``section`` is validated before
    anything is read or written.
    """
    ckpt = Path(ckpt_dir)
    cfg_path = ckpt / "config.json"
    try:
        parse_sparse_attention_config(section, source="section to export")
    except SparseAttentionConfigError as exc:
        raise ExportError(f"refusing to write an invalid section into {cfg_path}: {exc}") from exc
    cfg_path, data = _read_checkpoint_config(ckpt)
    merged = merge_section(data.get(SECTION_KEY), section, source=str(cfg_path))
    _require_writable(ckpt)
    data[SECTION_KEY] = merged  # position kept if present
    return write_text_atomic(cfg_path, _dumps(data))
