"""compat: the only place in sparse-attn that knows about vLLM releases.

Importing it is cheap and probes nothing: the installed vLLM is probed on the
first call that needs a fact (``probe()``, cached until ``reset_for_tests()``).
It exports the functions the version-free ``sparse_attn`` package calls:

* ``kv_cache_views(kv_cache, *, head_size, backend, isa=None)`` -> ``(key_cache, value_cache)``,
  zero-copy logical ``[num_blocks, block_size, num_kv_heads, head_size]`` views;
* ``write_kv_cache(key, value, kv_cache, slot_mapping, *, head_size, backend, isa=None)``;
* ``cache_writer(backend)`` -> the writer the sparse forward path must call, or
  ``None`` when vLLM already stored the new tokens before ``forward``;
* ``cpu_ops()`` -> the vLLM module holding the CPU attention op wrappers
  (``vllm._custom_ops`` up to 0.33, ``vllm._cpu_ops`` from 0.34), for tests and benchmarks;
* ``reset_for_tests()``.

The other boundaries live in submodules: ``compat.worker`` (model-load hook,
worker RPC, replacing an impl, the impl ``forward`` call), ``compat.model``
(attention layers, batch description and the phase rule) and ``compat.launch``
(server module, engine keyword arguments, server flags, ``VLLM_*`` variables).
``python -m compat`` prints what was decided and why.
"""

from __future__ import annotations

import importlib
import types
from typing import Callable

import torch

from compat import envs, layouts, patches
from compat.errors import (
    CompatError,
    HookError,
    ImplReplacementError,
    InvalidOverrideError,
    KVWriteError,
    OpsNotFoundError,
    UnknownBackendError,
    UnsupportedLayoutError,
    describe_version,
)
from compat.layouts import KVLayout
from compat.probe import CPU_OPS, BackendReport, CompatReport, OpsDecision, probe_cpu_ops, run_probe

__all__ = [
    "BackendReport",
    "CompatError",
    "CompatReport",
    "HookError",
    "ImplReplacementError",
    "InvalidOverrideError",
    "KVLayout",
    "KVWriteError",
    "OpsNotFoundError",
    "UnknownBackendError",
    "UnsupportedLayoutError",
    "cache_writer",
    "cpu_ops",
    "cpu_ops_decision",
    "kv_cache_views",
    "probe",
    "reset_for_tests",
    "write_kv_cache",
]

_report: CompatReport | None = None
_cpu_ops: list[OpsDecision] = []  # cpu_ops_decision(), once
#: backend name -> (view function, error-context function); built once from the report.
_bound: dict[str, tuple[Callable, Callable[[], str]]] = {}


def probe() -> CompatReport:
    """The cached report of what the installed vLLM does (probed on first call)."""
    global _report
    if _report is None:
        _report = run_probe()
    return _report


def reset_for_tests() -> None:
    """Forget the probe and parsed environment so the next call re-reads both, and undo
    every class-level patch compat made in vLLM (``compat.patches.undo_all``)."""
    global _report
    _report = None
    _bound.clear()
    _cpu_ops.clear()
    patches.undo_all()
    envs.reset_for_tests()


def _bind(backend: str) -> tuple[Callable, Callable[[], str], Callable]:
    """``(views, error context, fp8 quantiser)`` of ``backend``'s probed layout, bound once."""
    report = probe()
    entry = report.backend(backend)

    def context() -> str:
        return (
            f"backend {backend}, {describe_version(report.vllm_version)}, layout "
            f"{entry.layout.value if entry.layout else None} decided by {entry.layout_source} ({entry.layout_detail})"
        )

    if entry.layout is None:
        why = entry.import_error or entry.layout_detail or "no probe result"

        def refuse(kv_cache: torch.Tensor, head_size: int, isa: str | None, _context: Callable[[], str]) -> layouts.KVViews:
            raise UnsupportedLayoutError(
                f"no KV-cache layout is known for backend {backend} ({why})",
                observed=f"cache shape {list(kv_cache.shape)}",
                expected=f"one of the catalogue layouts ({', '.join(x.value for x in KVLayout)})",
                fix=f"set SPARSE_ATTN_KV_LAYOUT={backend}=<layout> if you know it, or pin a vLLM release listed in README.md",
                vllm_version=report.vllm_version,
            )

        _bound[backend] = (refuse, context, layouts.quantise_fp8)
    else:
        _bound[backend] = (layouts.VIEW_FUNCTIONS[entry.layout], context, layouts.FP8_QUANTISERS[entry.layout])
    return _bound[backend]


def kv_cache_views(kv_cache: torch.Tensor, *, head_size: int, backend: str, isa: str | None = None,
                   kv_cache_dtype: str = "auto") -> layouts.KVViews:
    """Zero-copy ``(key_cache, value_cache)`` of the cache vLLM hands ``backend``'s impl.

    ``kv_cache``: the tensor an impl's ``forward``/``do_kv_cache_update`` receives,
    in the probed layout's logical shape. Returns two views, each
    ``[num_blocks, block_size, num_kv_heads, head_size]``, sharing its storage; for
    an fp8 ``kv_cache_dtype`` (the layer's, vLLM's spelling) they are typed
    ``float8_e4m3fn`` / ``float8_e5m2`` over vLLM's ``uint8`` cache.
    ``isa``: the CPU attention ISA (``layer.isa``), needed for ``CPU_ATTN`` only.
    Raises ``UnsupportedLayoutError`` (a ValueError) when the tensor does not fit.
    """
    bound = _bound.get(backend) or _bind(backend)
    return bound[0](layouts.typed_cache(kv_cache, kv_cache_dtype), head_size, isa, bound[1])


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    head_size: int,
    backend: str,
    isa: str | None = None,
    check: bool = True,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` at ``slot_mapping``
    ``[num_tokens]`` (``block * block_size + offset``; negative = padding, skipped), in place.

    An fp8 ``kv_cache_dtype`` quantises as the backend's own writer does (``layouts.FP8_QUANTISERS``:
    round-to-nearest on the GPU layouts, toward zero on CPU_ATTN's) with
    ``k_scale`` / ``v_scale`` (the layer's 0-d fp32 tensors: no host read).
    ``check=False`` reads no device data on the host (safe inside CUDA-graph capture):
    no slot range check, and padding is skipped without data-dependent shapes."""
    key_cache, value_cache = kv_cache_views(kv_cache, head_size=head_size, backend=backend, isa=isa,
                                            kv_cache_dtype=kv_cache_dtype)
    quantise = (_bound.get(backend) or _bind(backend))[2]
    layouts.write(key, value, key_cache, value_cache, slot_mapping, check=check, k_scale=k_scale, v_scale=v_scale,
                  quantise=quantise)


def cache_writer(backend: str) -> Callable[..., None] | None:
    """The function the sparse forward path must call to store new tokens, or
    ``None`` when vLLM's ``do_kv_cache_update`` already stored them before ``forward``.

    The returned callable has ``write_kv_cache``'s signature.
    """
    return write_kv_cache if probe().backend(backend).writer == "adapter" else None


def cpu_ops_decision() -> OpsDecision:
    """Where vLLM's CPU attention op wrappers live, and why (decided once; ``python -m compat`` prints it)."""
    if not _cpu_ops:
        _cpu_ops.append(probe_cpu_ops())
    return _cpu_ops[0]


def cpu_ops() -> types.ModuleType:
    """The vLLM module holding ``cpu_attn_reshape_and_cache``, ``cpu_attention_with_kv_cache`` and
    the other CPU attention op wrappers: ``vllm._cpu_ops`` where it has them (0.34 on), else
    ``vllm._custom_ops``. Raises ``OpsNotFoundError`` (an ImportError) when no candidate holds them."""
    decision = cpu_ops_decision()
    if decision.module is None:
        raise OpsNotFoundError(
            "vLLM's CPU attention ops are not found",
            observed=decision.detail, expected=f"a module with {', '.join(CPU_OPS)}",
            fix="set SPARSE_ATTN_CPU_OPS_MODULE to the module that holds them, or pin a vLLM release listed in README.md",
            vllm_version=probe().vllm_version)
    return importlib.import_module(decision.module)
