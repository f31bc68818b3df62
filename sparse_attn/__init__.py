"""sparse_attn: skip-softmax (BLASST) sparse attention for vLLM. Version-free: every vLLM question goes through ``compat``."""

__version__ = "0.1.0"
