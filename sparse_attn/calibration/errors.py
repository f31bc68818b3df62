"""The error types of ``sparse_attn.calibration`` (a leaf module: imports nothing).

Every calibration error is a :class:`CalibrationError`, itself a ``ValueError``
so callers that catch bad input keep working. Its message says what was seen,
what was expected and how to fix it (a flag of ``sparse-attn calibrate`` that
exists, or a change to the data).
"""

from __future__ import annotations

__all__ = ["CalibrationDataError", "CalibrationError"]


class CalibrationError(ValueError):
    """Calibration cannot produce a trustworthy result; the message says why and how to fix it."""


class CalibrationDataError(CalibrationError):
    """Calibration prompts are missing, malformed, empty or too long."""
