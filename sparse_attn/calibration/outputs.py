"""Where ``sparse-attn calibrate`` may write: ``--output`` and ``--plot``, decided by path alone.

The report is written atomically (a temporary file beside the destination, then
``os.replace``), which replaces whatever the destination is: a symlink becomes a
regular file, a device node or FIFO is swapped for one, a file in a Hugging Face
snapshot stops pointing at its blob. So a destination is accepted only when it
is a regular file or a new name, in a real, writable directory, and nowhere in
the checkpoint:

* not inside the checkpoint tree (resolved: a link to it or a relative path
  through it counts), which covers ``config.json``, Qwen dual-chunk's
  ``sparse_attention_config.json`` (vLLM loads it when ``config.json`` has
  ``dual_chunk_attention_config``), weights and subdirectories;
* not a file a link in the checkpoint resolves to, nor anything in the Hugging
  Face cache repository of a snapshot checkpoint (``models--org--name/``: its
  ``blobs/``, ``refs/`` and other snapshots);
* not the user's calibration data, not under ``/proc`` or ``/sys``.

Nothing here opens a destination: refusing ``CKPT/model.safetensors`` reads no
byte of it, and a FIFO is recognised by ``lstat`` without blocking.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, Mapping

from sparse_attn.errors import CliError
from sparse_attn.jsonio import shorten

__all__ = ["DEFAULT_OUTPUT", "QWEN_DUAL_CHUNK_FILE", "check_destinations"]

#: ``--output`` when not given. Deliberately NOT ``sparse_attention_config.json``: vLLM's
#: Qwen dual-chunk attention models (HF config with ``dual_chunk_attention_config``) load
#: that file from the checkpoint directory.
DEFAULT_OUTPUT = "./sparse_attn_calibration.json"
#: A checkpoint file vLLM itself reads (Qwen dual-chunk attention's sparse settings).
QWEN_DUAL_CHUNK_FILE = "sparse_attention_config.json"
#: Pseudo-filesystems where a "file" is a kernel interface: writing there has effects.
_PSEUDO_ROOTS = (Path("/proc"), Path("/sys"))
#: Entries of the checkpoint tree looked at for links (a checkpoint holds tens of files).
_MAX_TREE_ENTRIES = 20000


def _real(path: Path) -> Path:
    """``path`` with symlinks resolved (also for a path that does not exist yet)."""
    return Path(os.path.realpath(path))


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def describe_kind(path: Path) -> str:
    """What ``path`` is, for a message ("a character device", "a FIFO (named pipe)", ...)."""
    try:
        return _kind(os.stat(path).st_mode)
    except OSError as exc:
        return f"not inspectable ({exc.strerror or exc})"


def _hub_repo(path: Path) -> Path | None:
    """The cache repository (``.../models--org--name``) of a Hugging Face snapshot path, or None."""
    parts = path.parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(("models--", "datasets--", "spaces--")):
            return Path(*parts[:i])
    return None


def _checkpoint_scope(ckpt: Path) -> tuple[list[Path], set[Path]]:
    """(directories nothing may be written into, files nothing may replace) for ``ckpt``:
    its tree and hub repository, and every target of a link inside it."""
    roots = [_real(ckpt)]
    for candidate in (ckpt.absolute(), _real(ckpt)):
        repo = _hub_repo(candidate)
        if repo is not None:
            roots.append(_real(repo))
    files: set[Path] = set()
    seen = 0
    for directory, dirnames, filenames in os.walk(ckpt, followlinks=False):
        for name in (*dirnames, *filenames):
            seen += 1
            entry = Path(directory) / name
            if entry.is_symlink():
                target = _real(entry)
                (roots.append if target.is_dir() else files.add)(target)
        if seen > _MAX_TREE_ENTRIES:
            break
    return roots, files


def _refuse(flag: str, path: Path, what: str, fix: str) -> CliError:
    return CliError(f"{flag} {shorten(str(path))} {what}. Fix: {fix}")


def _check_one(flag: str, path: Path, ckpt: Path, roots: list[Path], files: set[Path],
               protected: Mapping[Path, str]) -> Path:
    try:
        info: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise _refuse(flag, path, f"cannot be inspected ({exc.strerror or exc})", "pass a plain file path") from None
    target = _real(path)
    beside = roots[0].parent / f"{roots[0].name}-{Path(DEFAULT_OUTPUT).name}"
    fix = f"pass a new file outside the checkpoint, e.g. --output {shorten(str(beside))}"
    if target in protected:
        raise _refuse(flag, path, f"is {protected[target]}; writing the calibration report there would destroy it",
                      f"pass another path (the default is {DEFAULT_OUTPUT}); to put the section into the checkpoint's "
                      f"config.json use --update_checkpoint_config, which merges it and keeps every other key")
    if any(_within(target, root) for root in roots) or target in files:
        raise _refuse(flag, path, f"is inside the checkpoint {shorten(str(ckpt))} (resolved: {shorten(str(target))}); "
                                  f"calibrate never creates or replaces a file of the model",
                      f"{fix}; --update_checkpoint_config merges the section into config.json")
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise _refuse(flag, path, "is a directory; expected a file path",
                      f"pass e.g. {flag} {path / Path(DEFAULT_OUTPUT).name}")
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise _refuse(flag, path, f"is a symbolic link (to {shorten(str(target))}); the report would replace the link "
                                  f"itself with a regular file", "pass the real path of the file you mean, or a new path")
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise _refuse(flag, path, f"is {_kind(info.st_mode)}, not a regular file; the report would replace it",
                      "pass a regular file or a new file name in a real directory")
    directory = target.parent
    if any(_within(directory, root) for root in _PSEUDO_ROOTS):
        raise _refuse(flag, path, f"is in {directory}, a kernel pseudo-filesystem, not a directory for files",
                      "pass a path on a real filesystem")
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise CliError(f"{flag} {shorten(str(path))}: directory {shorten(str(path.absolute().parent))} "
                       f"does not exist or is not writable")
    return target


def check_destinations(ckpt: Path, written: Mapping[str, Path], data_sources: Iterable[str]) -> None:
    """Refuse (``CliError``) every destination in ``written`` (flag -> path) that calibrate
    must not replace (module docstring). ``data_sources`` are the user's calibration data
    paths (``--prompts_file``, ``--calib_data_dir``). Reads no destination."""
    from sparse_attn.workloads.prompts import SAMPLES_FILE

    protected: dict[Path, str] = {
        _real(ckpt / "config.json"): "the checkpoint's config.json (the model's configuration)",
        _real(ckpt / QWEN_DUAL_CHUNK_FILE): (f"the checkpoint's {QWEN_DUAL_CHUNK_FILE}, which vLLM loads for Qwen "
                                             f"dual-chunk attention models (config.json dual_chunk_attention_config)"),
    }
    for source in data_sources:
        src = Path(source)
        protected[_real(src / SAMPLES_FILE if src.is_dir() else src)] = f"your calibration data ({shorten(source)})"
    roots, files = _checkpoint_scope(ckpt)
    targets = {flag: _check_one(flag, path, ckpt, roots, files, protected) for flag, path in written.items()}
    if len(set(targets.values())) != len(targets):
        raise CliError(f"--output and --plot name the same file ({shorten(str(targets['--output']))}). "
                       f"Fix: give them different paths")
