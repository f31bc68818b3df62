"""Build the ``sparse_attention_config`` section and write it atomically.

* :func:`build_sparse_attention_config` - the one writer of the format: a
  :class:`~sparse_attn.config.SparseAttentionConfig` built from per-phase fits,
  targets and producer info, serialised by its ``to_dict()`` and validated by
  parsing it back with :func:`sparse_attn.config.parse_sparse_attention_config`.
* :func:`write_json_atomic` - the ``--output`` artifact.
* :func:`update_checkpoint_config` - merge the section into ``CKPT/config.json``.

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
    parse_sparse_attention_config,
)
from .errors import CalibrationError
from .fit import FitResult

__all__ = [
    "PRODUCER_NAME",
    "ExportError",
    "build_sparse_attention_config",
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
) -> dict[str, Any]:
    """The ``sparse_attention_config`` section for ``fits`` (phase -> fit).

    The one writer of the format: it builds a :class:`SparseAttentionConfig`
    and returns its ``to_dict()``, then parses that back with the runtime's
    parser, so a bad value raises ``SparseAttentionConfigError`` here rather
    than at serve time. ``targets`` defaults to each ``FitResult.target_sparsity``.
    Phases absent from ``fits`` are omitted (they run dense). ``producer_version``
    defaults to the installed sparse-attn version.
    """
    if not fits:
        raise ExportError("no phase was calibrated; nothing to export (calibrate at least prefill or decode)")
    unknown = [p for p in fits if p not in PHASES]
    if unknown:
        raise ExportError(f"unknown phase(s) {unknown}; expected {list(PHASES)}")
    targets = dict(targets or {})
    for phase, fit in fits.items():
        if phase not in targets and isinstance(fit, FitResult):
            targets[phase] = fit.target_sparsity
    coefficients = {p: _coefficients(fits[p]) for p in PHASES if p in fits}
    config = SparseAttentionConfig(
        group=SkipSoftmaxGroup(
            name=group_name,
            targets=tuple(sorted(set(target_classes or ()))),
            ignore=tuple(ignore or ()),
            formula=DEFAULT_FORMULA,
            fits={p: PhaseFit(a=c["a"], b=c["b"]) for p, c in coefficients.items()},
            target_sparsity={p: float(targets[p]) for p in PHASES if p in targets and p in fits},
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
        if match is None or _pid_alive(int(match["pid"])):
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


def update_checkpoint_config(ckpt_dir: str | Path, section: Mapping[str, Any]) -> Path:
    """Set ``sparse_attention_config`` in ``ckpt_dir/config.json`` atomically.

    Every other key is preserved, in its original order (an existing section is
    replaced in place; a new one is appended). Refuses with :class:`ExportError`
    when config.json is missing, not valid JSON, not an object, or the
    directory is not writable. ``section`` is validated before anything is written.
    """
    ckpt = Path(ckpt_dir)
    cfg_path = ckpt / "config.json"
    try:
        parse_sparse_attention_config(section, source="section to export")
    except SparseAttentionConfigError as exc:
        raise ExportError(f"refusing to write an invalid section into {cfg_path}: {exc}") from exc
    if not ckpt.is_dir():
        raise ExportError(f"checkpoint directory {ckpt} does not exist. Fix: pass the model directory that holds config.json")
    try:
        text = cfg_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ExportError(
            f"{cfg_path} does not exist; refusing to create a config.json from scratch. "
            f"Fix: pass a Hugging Face checkpoint directory, or use --output to write the section on its own"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ExportError(f"cannot read {cfg_path}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ExportError(
            f"{cfg_path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); refusing to overwrite it. "
            f"Fix: repair or restore config.json first"
        ) from None
    if not isinstance(data, dict):
        raise ExportError(f"{cfg_path} holds a JSON {type(data).__name__}, not an object; refusing to overwrite it")
    if not os.access(ckpt, os.W_OK):
        raise ExportError(
            f"checkpoint directory {ckpt} is not writable. Fix: run with write permission, copy the checkpoint, "
            f"or write the section with --output and merge it later"
        )
    data[SECTION_KEY] = json.loads(json.dumps(dict(section)))  # plain JSON types, position kept if present
    return write_text_atomic(cfg_path, _dumps(data))
