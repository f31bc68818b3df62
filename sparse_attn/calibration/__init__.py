"""Offline calibration of the skip-softmax threshold curve (vLLM-free building blocks).

* :mod:`.data`   - RULER-style synthetic long-context prompts, generated locally,
  and the loader/validator for a prepared calibration set.
* :mod:`.fit`    - candidate threshold grid, count merging, the exponential fit.
* :mod:`.export` - the ``sparse_attention_config`` section, atomic writes into
  ``--output`` and ``CKPT/config.json``.
* :mod:`.plot`   - optional PNG of the fit per phase (needs matplotlib).

Every error raised here derives from :class:`CalibrationError` (a ``ValueError``).
"""

from .fit import CalibrationError

__all__ = ["CalibrationError"]
