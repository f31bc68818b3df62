"""The calibration prompt set: :class:`CalibrationSample`, the prompt-file format,
loading, validation, and the one check of prompt lengths against the engine.

Prompt-file format (``--calib_data_dir`` / ``--prompts_file``)
--------------------------------------------------------------
A directory containing ``samples.jsonl``, or a single file:

* ``*.jsonl`` - one JSON value per line; blank lines are ignored. Each value is
  either a string (the prompt) or an object with exactly one of
  ``"prompt": str`` or ``"prompt_token_ids": [int, ...]``, and optionally
  ``"task"``, ``"answers"`` (list of str), ``"target_len"`` (int).
* ``*.json`` - a JSON list of such values.
* anything else (e.g. ``prompts.txt``) - one prompt per non-empty line (use
  JSONL for prompts that contain newlines).

Loading needs no tokenizer (:func:`load_prompts`), so malformed files fail
before transformers or vLLM is imported. :func:`check_lengths` is the single
place that measures prompts and enforces ``prompt tokens + decode tokens <=
max_model_len``, for loaded and synthetic prompts alike. Errors are
:class:`~sparse_attn.errors.CalibrationDataError` naming the file
and line (or value index), what is wrong, and the fix.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from sparse_attn.errors import CalibrationDataError
from sparse_attn.jsonio import JsonInputError, loads, read_text_file, shorten

__all__ = ["SAMPLES_FILE", "CalibrationSample", "ChatTemplatePrompts", "Tokenizer", "check_lengths", "check_vocabulary",
           "load_prompts"]

#: The file a ``--calib_data_dir`` directory must contain.
SAMPLES_FILE = "samples.jsonl"
#: Largest prompt file read (64 prompts of 16k tokens are ~5 MB of text).
MAX_PROMPTS_BYTES = 1 << 30
#: The keys a sample object may have.
SAMPLE_KEYS = ("prompt", "prompt_token_ids", "task", "answers", "target_len")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ChatTemplatePrompts:
    """A :class:`Tokenizer` whose ``encode(text)`` is the chat template's own token ids for one user
    turn holding ``text`` plus the generation prompt (a Hugging Face tokenizer's
    ``apply_chat_template(..., tokenize=True)``; never the template's text tokenised again, which
    adds a second BOS). Synthetic calibration prompts are sized and measured through it."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)


@dataclass(frozen=True)
class CalibrationSample:
    """One calibration prompt (text or token ids) plus bookkeeping."""

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    task: str | None = None
    target_len: int | None = None  # length bin the sample was sized for
    num_tokens: int | None = None  # measured prompt tokens, when known
    answers: tuple[str, ...] = ()
    source: str | None = field(default=None, compare=False)  # "file:line" for loaded samples


def _err(where: str, what: str, fix: str) -> CalibrationDataError:
    return CalibrationDataError(f"{where}: {what}. Fix: {fix}")


_JSONL_FIX = 'each line must be a JSON string or an object with "prompt": "..." or "prompt_token_ids": [1, 2, ...]'


def _sample_from_value(value: Any, where: str) -> CalibrationSample:
    if isinstance(value, str):
        if not value.strip():
            raise _err(where, "empty prompt", "remove the line or give it text")
        return CalibrationSample(prompt=value, source=where)
    if not isinstance(value, dict):
        raise _err(where, f"expected a JSON object or string, got {type(value).__name__}", _JSONL_FIX)
    # A misspelt key ("promt_token_ids") would be ignored and the sample mean something else.
    unknown = [key for key in value if key not in SAMPLE_KEYS]
    hint = ""
    if unknown:
        key = str(unknown[0])
        close = difflib.get_close_matches(key.lower(), SAMPLE_KEYS, n=1, cutoff=0.75) if len(key) < 64 else []
        hint = (f"unknown key {shorten(key, 60)!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; a sample has only {', '.join(SAMPLE_KEYS)}")
    has_prompt, has_ids = "prompt" in value, "prompt_token_ids" in value
    if has_prompt == has_ids:
        raise _err(where, 'needs exactly one of "prompt" or "prompt_token_ids"' + (" (found both)" if has_prompt else "")
                   + (f"; {hint}" if hint else ""), _JSONL_FIX)
    if hint:
        raise _err(where, hint, "rename or remove the key")
    prompt = ids = None
    if has_prompt:
        prompt = value["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise _err(where, f'"prompt" must be a non-empty string, got {prompt!r:.60}', _JSONL_FIX)
    else:
        raw = value["prompt_token_ids"]
        if (
            not isinstance(raw, list)
            or not raw
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw)
        ):
            raise _err(where, '"prompt_token_ids" must be a non-empty list of non-negative integers', _JSONL_FIX)
        ids = tuple(raw)
    answers = value.get("answers", ())
    if isinstance(answers, str):
        answers = (answers,)
    if not isinstance(answers, (list, tuple)) or not all(isinstance(a, str) for a in answers):
        raise _err(where, '"answers" must be a list of strings', "fix or drop the answers field")
    target_len = value.get("target_len")
    if target_len is not None and (isinstance(target_len, bool) or not isinstance(target_len, int) or target_len <= 0):
        raise _err(where, f'"target_len" must be a positive integer, got {target_len!r}', "fix or drop the target_len field")
    task = value.get("task")
    if task is not None and not isinstance(task, str):
        raise _err(where, f'"task" must be a string, got {task!r}', "fix or drop the task field")
    return CalibrationSample(
        prompt=prompt,
        prompt_token_ids=ids,
        task=task,
        target_len=target_len,
        num_tokens=len(ids) if ids is not None else None,
        answers=tuple(answers),
        source=where,
    )


def _read_text(file: Path) -> str:
    try:
        return read_text_file(file, what="prompt file", max_bytes=MAX_PROMPTS_BYTES, fix="check the path and permissions")
    except JsonInputError as exc:
        raise CalibrationDataError(f"{file}: {exc.what}. Fix: {exc.fix}") from None


def _json(text: str, where: str, fix: str) -> Any:
    try:
        return loads(text, where=where, fix=fix)
    except JsonInputError as exc:
        raise CalibrationDataError(str(exc)) from None


def _load_file(file: Path) -> list[CalibrationSample]:
    text = _read_text(file)
    samples = []
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{file}:{lineno}"
            samples.append(_sample_from_value(_json(line, where, _JSONL_FIX), where))
    elif suffix == ".json":
        values = _json(text, str(file), "write a JSON list of prompts")
        if not isinstance(values, list):
            raise _err(str(file), f"expected a JSON list of prompts, got {type(values).__name__}", "write a JSON list, or use JSONL")
        samples = [_sample_from_value(v, f"{file}[{i}]") for i, v in enumerate(values)]
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                samples.append(CalibrationSample(prompt=line, source=f"{file}:{lineno}"))
    return samples


def load_prompts(path: str | Path) -> list[CalibrationSample]:
    """Load and validate a prompt set: a directory holding ``samples.jsonl``, or
    one ``.jsonl`` / ``.json`` / text file (format in the module docstring).

    Token-id samples get ``num_tokens``; text prompts are measured later by
    :func:`check_lengths`. Raises :class:`CalibrationDataError` for a missing,
    unreadable, malformed or empty set.
    """
    p = Path(path)
    if p.is_dir():
        file = p / SAMPLES_FILE
        if not file.exists():  # a FIFO or device named samples.jsonl is refused by _read_text, without blocking
            found = sorted(x.name for x in p.iterdir())[:10]
            raise _err(
                str(p),
                f"no {SAMPLES_FILE} in the calibration directory (found: {found or 'nothing'})",
                f"put the prompts in {p / SAMPLES_FILE} (one JSON object per line), or pass a "
                f".jsonl/.json/.txt file with --prompts_file",
            )
    elif p.exists():
        file = p  # a FIFO or device is refused by _read_text, without blocking
    else:
        raise _err(str(p), "no such file or directory", "check the calibration data path")
    samples = _load_file(file)
    if not samples:
        raise _err(str(file), "the calibration set is empty", "add at least one prompt (more than 8 long prompts recommended)")
    return samples


def check_vocabulary(samples: Sequence[CalibrationSample], vocab_size: int, *, source: str) -> None:
    """Every token id below ``vocab_size`` (the model's embedding rows), else
    :class:`CalibrationDataError` naming the sample, the id and where the size came from."""
    for i, sample in enumerate(samples):
        ids = sample.prompt_token_ids or ()
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise CalibrationDataError(
                f"sample {i} ({sample.source or sample.task}) has token id {shorten(str(bad), 40)}, but the model's "
                f"vocabulary has {vocab_size} tokens (ids 0..{vocab_size - 1}, {source}). Fix: tokenize the prompts with "
                f"this model's tokenizer, or give them as text (\"prompt\")"
            )


def check_lengths(
    samples: Sequence[CalibrationSample],
    tokenizer: Tokenizer | None,
    *,
    max_model_len: int,
    decode_tokens: int,
) -> list[CalibrationSample]:
    """Token-id copies of ``samples``, each checked to fit the engine.

    Text prompts are encoded with ``tokenizer`` (may be None only when every
    sample already has token ids). Every sample must satisfy ``len(ids) +
    decode_tokens <= max_model_len``, else :class:`CalibrationDataError` names
    the sample (index and ``file:line``), its length and the flags that fix it.
    Returns samples with ``prompt_token_ids`` and ``num_tokens`` set.
    """
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0:
        raise CalibrationDataError(f"max_model_len must be a positive integer, got {max_model_len!r}")
    checked = []
    for i, sample in enumerate(samples):
        if sample.prompt_token_ids:
            ids = tuple(sample.prompt_token_ids)
        elif tokenizer is None:
            raise CalibrationDataError(
                f"sample {i} ({sample.source or sample.task}) is text; a tokenizer is needed to measure it "
                f"against --max_model_len {max_model_len}"
            )
        else:
            ids = tuple(tokenizer.encode(sample.prompt))
        if len(ids) + decode_tokens > max_model_len:
            raise CalibrationDataError(
                f"sample {i} ({sample.source or sample.task}) has {len(ids)} tokens + {decode_tokens} decode tokens "
                f"> --max_model_len {max_model_len}. Fix: raise --max_model_len, lower --decode_tokens, "
                f"or shorten or drop the sample"
            )
        checked.append(CalibrationSample(prompt_token_ids=ids, task=sample.task, target_len=sample.target_len,
                                         num_tokens=len(ids), answers=sample.answers, source=sample.source))
    return checked
