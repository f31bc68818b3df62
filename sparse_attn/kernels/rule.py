"""The per-sequence threshold rule a kernel evaluates itself (no lambda tensor per launch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .checks import effective_lambda


@dataclass(frozen=True)
class LambdaRule:
    """A per-sequence threshold the kernel computes itself: ``lambda_s =
    effective_lambda(scale_factor, kv_len_s, window)`` (``kernels.checks``: ``scale /
    min(kv_len, window)``, 0 = dense where that is not in (0, 1)), with ``kv_len_s`` read from
    ``seq_lens`` on the device: no lambda tensor, so a captured decode layer launches no torch
    op for it.  ``scale_factor`` a finite float >= 0, ``window`` tokens or ``None``."""

    scale_factor: float
    window: int | None = None

    def lambdas(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """float32 ``[S]`` on ``seq_lens``' device (the device form of the rule)."""
        return effective_lambda(self.scale_factor, seq_lens, self.window)

    def host_lambdas(self, seq_lens: Sequence[int]) -> list[float]:
        """The host form, one float per host KV length."""
        return [effective_lambda(self.scale_factor, n, self.window) for n in seq_lens]
