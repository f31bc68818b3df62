"""Worker extension for the engine tests (``worker_extension_cls``): puts every
attention layer back on vLLM's own impl class after the plugin made it sparse,
so one engine start can serve the same prompts sparse and then natively.

The native class is found without asking the code under test: it is the first
class in the sparse impl's MRO that vLLM itself defines (the plugin's impl
subclasses the native one and holds the native instance's state). A new instance
of that class with the same state takes the layer's ``impl`` (``__class__``
assignment is refused: vLLM 0.29's CPU impl class is laid out differently from
the subclass), so vLLM's own ``forward`` runs on exactly that state.
"""

from __future__ import annotations


def _attention_layers(model):
    return [(name, module) for name, module in model.named_modules() if hasattr(module, "impl")]


def _native_class(impl) -> type:
    return next(cls for cls in type(impl).__mro__ if cls.__module__.startswith("vllm."))


def _native_copy(impl):
    cls = _native_class(impl)
    native = object.__new__(cls)
    if hasattr(native, "__dict__"):
        native.__dict__.update(getattr(impl, "__dict__", {}))
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(impl, name):
                object.__setattr__(native, name, getattr(impl, name))
    return native


def _shape(cache) -> list[int] | None:
    cache = cache[0] if isinstance(cache, (list, tuple)) and cache else cache
    return list(cache.shape) if hasattr(cache, "shape") else None


class NativeSwitch:
    """Methods become worker RPCs: ``llm.collective_rpc("native_switch_restore")``."""

    def native_switch_restore(self) -> list[str]:
        """Switch each non-native impl back to its vLLM class; the layers switched."""
        switched = []
        for name, layer in _attention_layers(self.model_runner.get_model()):
            if type(layer.impl) is not _native_class(layer.impl):
                layer.impl = _native_copy(layer.impl)
                switched.append(name)
        return switched

    def native_switch_describe(self) -> list[dict]:
        """Per attention layer: its name, impl class and the KV-cache shape the worker allocated."""
        return [{"name": name, "impl": f"{type(layer.impl).__module__}.{type(layer.impl).__qualname__}",
                 "kv_cache_shape": _shape(getattr(layer, "kv_cache", None))}
                for name, layer in _attention_layers(self.model_runner.get_model())]
