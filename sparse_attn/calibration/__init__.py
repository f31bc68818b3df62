"""Offline calibration of the skip-softmax threshold curve (vLLM-free building blocks).

The prompts it measures (synthetic, task kinds, prompt files) are :mod:`sparse_attn.workloads`'.

* :mod:`.fit`       - the exponential fit per phase.
* :mod:`.export`    - the ``sparse_attention_config`` section, atomic writes into
  ``--output`` and ``CKPT/config.json``.
* :mod:`.plot`      - optional PNG of the fit per phase (needs matplotlib).
* :mod:`.errors`    - :class:`CalibrationError` (a ``ValueError``), the base of every
  error raised here.
"""

from .errors import CalibrationError

__all__ = ["CalibrationError"]
