"""Reading a checkpoint's ``config.json``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparse_attn import jsonio

from .errors import SparseAttentionConfigError
from .parse import read_section
from .schema import SECTION_KEY, SparseAttentionConfig

__all__ = ["MAX_CONFIG_BYTES", "config_value", "load_from_checkpoint", "read_config_json", "text_model_config"]


#: Largest ``config.json`` read (Hugging Face configs are kilobytes; a few with big
#: label maps reach a megabyte). 16 MiB keeps the parse and the depth walk of the
#: largest accepted file near a second here (issue 19: bounded time; 23 MB took 4.4 s).
MAX_CONFIG_BYTES = 16 << 20
_CONFIG_FIX = "point at a Hugging Face checkpoint directory whose config.json is a UTF-8 JSON object (repair or re-download it)"


def read_config_json(ckpt_dir: str | Path) -> dict[str, Any]:
    """``ckpt_dir/config.json`` as a dict: the one reader of a checkpoint's config
    (``sparse-attn serve``, ``calibrate`` and its checkpoint update all use it).
    Only that file: never the Qwen dual-chunk ``sparse_attention_config.json`` beside it.

    Raises ``SparseAttentionConfigError`` (path ``config.json``) when the file is
    missing, not a regular file (a FIFO is refused without blocking), larger than
    ``MAX_CONFIG_BYTES``, not UTF-8, not JSON (including nesting deeper than
    ``jsonio.MAX_DEPTH`` and integers Python will not convert), or not an object.
    """
    path = Path(ckpt_dir) / "config.json"
    try:
        data = jsonio.read_json_file(path, what="config.json", max_bytes=MAX_CONFIG_BYTES, fix=_CONFIG_FIX)
    except jsonio.JsonInputError as exc:
        raise SparseAttentionConfigError.unreadable("config.json", str(path), exc.what, exc.fix) from None
    if not isinstance(data, dict):
        raise SparseAttentionConfigError("config.json", type(data).__name__, "a JSON object at the top level",
                                         "repair config.json", source=str(path))
    return data


def load_from_checkpoint(ckpt_dir: str | Path) -> SparseAttentionConfig | None:
    """The skip-softmax config in ``ckpt_dir/config.json``; None when the section is
    absent, belongs to someone else, or has no skip-softmax group.

    Raises ``SparseAttentionConfigError`` when config.json is missing, not
    JSON, or the skip-softmax group is malformed.
    """
    path = Path(ckpt_dir) / "config.json"
    return read_section(read_config_json(ckpt_dir).get(SECTION_KEY), source=str(path)).config


def text_model_config(model_cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's part of a ``config.json``: its ``text_config`` where the checkpoint nests one (Gemma 3 and
    other multimodal configs), else the config itself."""
    nested = model_cfg.get("text_config")
    return nested if isinstance(nested, Mapping) and nested else model_cfg


def config_value(model_cfg: Mapping[str, Any], key: str) -> Any:
    """``key`` of a ``config.json``: at its top level, else in its ``text_config``; None where neither has it."""
    value = model_cfg.get(key)
    return value if value is not None else text_model_config(model_cfg).get(key)
