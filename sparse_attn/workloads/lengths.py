"""The length bins calibrate and eval share, and the room each prompt leaves in its bin.

``sparse-attn calibrate`` (without ``--calib_max_seqlen`` / ``--calib_min_seqlen``) and
``sparse-attn eval`` (without ``--lengths``) both take :func:`default_lengths`, and both size task
prompts to ``bin - decode_tokens - TASK_PROMPT_MARGIN``, so the two commands with their defaults
see one prompt mix: sparsity at one threshold moves with the prompt length.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from sparse_attn.errors import CalibrationDataError

__all__ = ["DEFAULT_CALIB_MAX_SEQLEN", "DEFAULT_CALIB_MIN_SEQLEN", "TASK_PROMPT_MARGIN", "default_lengths", "largest_fitting",
           "length_bins"]

#: ``--calib_max_seqlen`` when not given; lowered to the model's limit when that is shorter.
DEFAULT_CALIB_MAX_SEQLEN = 16384
#: ``--calib_min_seqlen`` when not given (the parser's default).
DEFAULT_CALIB_MIN_SEQLEN = 1024
#: Room kept in each length bin for the answer and the decode steps beyond ``--decode_tokens`` (task prompts).
TASK_PROMPT_MARGIN = 40


def length_bins(max_seqlen: int, min_seqlen: int = 1024, num_length_bins: int | None = None) -> list[int]:
    """``[max_seqlen, max_seqlen // 2, ...]`` while ``>= min_seqlen`` (descending), capped to ``num_length_bins``."""
    for name, value in (("max_seqlen", max_seqlen), ("min_seqlen", min_seqlen)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CalibrationDataError(f"{name} must be a positive integer number of tokens, got {value!r}")
    if max_seqlen < min_seqlen:
        raise CalibrationDataError(
            f"max_seqlen={max_seqlen} is below the length floor min_seqlen={min_seqlen}; "
            f"raise --calib_max_seqlen or lower --calib_min_seqlen"
        )
    if num_length_bins is not None and (isinstance(num_length_bins, bool) or not isinstance(num_length_bins, int) or num_length_bins < 1):
        raise CalibrationDataError(f"num_length_bins must be a positive integer or None, got {num_length_bins!r}")
    bins = []
    length = max_seqlen
    while length >= min_seqlen:
        bins.append(length)
        length //= 2
    return bins[:num_length_bins] if num_length_bins is not None else bins


def default_lengths(model_config: Mapping[str, Any]) -> list[int]:
    """The length bins ``sparse-attn calibrate`` uses without ``--calib_max_seqlen`` / ``--calib_min_seqlen``
    (descending): ``sparse-attn eval`` scores the same lengths by default, so that the two commands with their
    defaults see the same prompt mix (sparsity at one threshold moves with prompt length, README)."""
    from compat.launch import model_length_limit

    limit = model_length_limit(model_config)
    top = min(DEFAULT_CALIB_MAX_SEQLEN, limit[0]) if limit is not None else DEFAULT_CALIB_MAX_SEQLEN
    return length_bins(top, min(DEFAULT_CALIB_MIN_SEQLEN, top))


def largest_fitting(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """Bisection between a haystack size that fits its budget (``fits(lo)``) and one that does not
    (``not fits(hi)``): the last size that fits, probing the same sizes every time (the built-in
    prompts are a pure function of their seed, so the search must be too)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
