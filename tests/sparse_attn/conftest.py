"""Shared set-up of the sparse_attn tests."""

import os

import torch

# Triton reads TRITON_INTERPRET once, when it is first imported. Set it before any test
# module imports triton, so on a machine without a GPU every Triton test runs under the
# interpreter whatever order pytest collects the modules in (tox sets it too; a direct
# `pytest tests/sparse_attn` did not, and test_kernels_capture.py then imported triton first).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
