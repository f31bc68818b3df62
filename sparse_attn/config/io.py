"""Reading a checkpoint's ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import SparseAttentionConfigError
from .parse import read_section
from .schema import SECTION_KEY, SparseAttentionConfig

__all__ = ["load_from_checkpoint", "read_config_json"]


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
