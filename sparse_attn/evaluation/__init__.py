"""``sparse-attn eval``: held-out accuracy and sparsity of a calibrated checkpoint, dense vs sparse."""
