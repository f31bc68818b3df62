"""The error types of ``sparse_attn.calibration``.

Both are defined in the leaf :mod:`sparse_attn.errors`, because :mod:`sparse_attn.workloads`
(below calibration, which it may not import) raises :class:`CalibrationDataError` too.
"""

from __future__ import annotations

from sparse_attn.errors import CalibrationDataError, CalibrationError

__all__ = ["CalibrationDataError", "CalibrationError"]
