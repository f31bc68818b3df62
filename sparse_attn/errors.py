"""User-facing errors of the ``sparse-attn`` commands.

A leaf module (imports nothing of the project), so the subcommand modules
(calibration, evaluation, demo, workloads) and their dispatcher ``sparse_attn.cli``
share one error type without importing each other.
"""

from __future__ import annotations

#: Exit status of a command that failed on its arguments or inputs.
EXIT_USAGE = 2


class CliError(Exception):
    """A user-facing failure: printed without a traceback, exit status ``EXIT_USAGE``."""


class CalibrationError(ValueError):
    """Calibration cannot produce a trustworthy result; the message says why and how to fix it.

    A ``ValueError``, so callers that catch bad input keep working. Its message says what was
    seen, what was expected and how to fix it (a flag of ``sparse-attn calibrate`` that exists,
    or a change to the data)."""


class CalibrationDataError(CalibrationError):
    """Prompts or tasks (``sparse_attn.workloads``: calibration's and eval's, built in or read from a
    prompt file) are missing, malformed, empty or do not fit their length."""
