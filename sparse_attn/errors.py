"""User-facing errors of the ``sparse-attn`` commands.

A leaf module (imports nothing of the project), so the subcommand modules
(calibration, demo) and their dispatcher ``sparse_attn.cli`` share one error
type without importing each other.
"""

from __future__ import annotations

#: Exit status of a command that failed on its arguments or inputs.
EXIT_USAGE = 2


class CliError(Exception):
    """A user-facing failure: printed without a traceback, exit status ``EXIT_USAGE``."""
