"""Demo assets for real-engine tests: a tiny structured Llama checkpoint built offline."""

__all__ = ["build_tiny_llama"]


def __getattr__(name):  # lazy, so `python -m sparse_attn.demo.tiny_model` runs cleanly
    if name == "build_tiny_llama":
        from .tiny_model import build_tiny_llama

        return build_tiny_llama
    raise AttributeError(name)
