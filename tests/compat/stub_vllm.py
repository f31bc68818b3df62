"""Writes a stub ``vllm`` package of a given era onto disk for probe tests.

The stubs carry only what the probe reads (distribution metadata, backend
classes with or without ``get_kv_cache_shape``, the 0.29+ KV-cache view
construction). They exercise the probe's decision logic; that each real release
answers the way its stub does is proven by the tox matrix (``tests/matrix``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

SHAPES = {
    "blocks-first": "return (num_blocks, 2, block_size, num_kv_heads, head_size)",
    "kv-first": "return (2, num_blocks, block_size, num_kv_heads, head_size)",
    "packed": "return (num_blocks, num_kv_heads, block_size, 2 * head_size)",
    "cpu-hnd-kv-first": "return (2, num_blocks, num_kv_heads, block_size, head_size)",
    "raises": "raise RuntimeError('Current vLLM config is not set')",
}

MODULES = {"FLASHINFER": ("flashinfer", "FlashInferBackend"), "FLASH_ATTN": ("flash_attn", "FlashAttentionBackend"), "CPU_ATTN": ("cpu_attn", "CPUAttentionBackend")}

VIEW_CONSTRUCTION = '''
import torch
from dataclasses import dataclass

@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self):
        return self.block_size * self.num_kv_heads * 2 * self.head_size * self.dtype.itemsize

@dataclass
class KVCacheTensor:
    size: int
    layers: list
    layer_stride: int
    block_stride: int
    offset: int = 0

def create_kv_cache_views(raw, spec, num_blocks, layout, kv_cache_tensor, kernel_block_size=None):
    # As vLLM 0.29+: one logical [B, H, N, C] view per layer, its page interior
    # ordered by ``layout`` (layer_view_order = physical order of B, H, N, C).
    logical = (num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
    order = tuple(i - 1 for i in layout.value if i != 0)
    physical = tuple(logical[i] for i in order)
    flat = raw[: num_blocks * spec.page_size_bytes].view(spec.dtype)
    return [flat.view(physical).permute(*(order.index(i) for i in range(4)))]
'''


KV_CACHE_LAYOUT = '''
import enum

class KVCacheLayout(enum.Enum):
    LBHNC = (0, 1, 2, 3, 4)
    LBNHC = (0, 1, 3, 2, 4)
    LHBNC = (0, 2, 1, 3, 4)
    BLHNC = (1, 0, 2, 3, 4)
    BLNHC = (1, 0, 3, 2, 4)
    BHLNC = (1, 2, 0, 3, 4)
'''

# vLLM 0.29+ v1/attention/backends/utils.py: the per-backend candidates the
# engine core resolves from (the real one also merges several backends).
RESOLVER = '''
from vllm.v1.kv_cache_layout import KVCacheLayout

_DEFAULT_LAYOUT_PREFERENCE = (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC,
                              KVCacheLayout.BLHNC, KVCacheLayout.BHLNC, KVCacheLayout.LHBNC)

def get_supported_kv_cache_layouts(backends):
    lists = [l for b in backends if (l := b.supported_kv_cache_layouts()) is not None] or [_DEFAULT_LAYOUT_PREFERENCE]
    return list(lists[0])
'''


def write_stub(root: Path, *, version: str = "0.25.1", distribution: str = "vllm", backends: dict[str, dict] | None = None,
               view_construction: bool = False, registry: bool = True) -> Path:
    """Create ``root/vllm`` and its dist-info. ``backends[name]`` keys: ``shape`` (a SHAPES key or
    None for no method), ``flag`` (forward_includes_kv_cache_update, or None to omit it), ``import_error``,
    ``layouts`` (0.29+ ``supported_kv_cache_layouts()``: a tuple of KVCacheLayout names, ``None`` for the
    base class's ``None``, or ``"absent"`` for no method; default ``None``)."""
    pkg = root / "vllm"
    (pkg / "v1" / "attention" / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    for sub in ("v1", "v1/attention"):
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "v1" / "attention" / "backends" / "__init__.py").write_text("")
    if distribution:
        info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    members = []
    for name, spec in (backends or {}).items():
        module, cls = MODULES[name]
        members.append(f"    {name} = 'vllm.v1.attention.backends.{module}.{cls}'")
        body = [f"class {cls}:"]
        if spec.get("import_error"):
            body = [f"raise ImportError({spec['import_error']!r})"]
        else:
            if spec.get("flag") is not None:
                body.append(f"    forward_includes_kv_cache_update = {spec['flag']}")
            if spec.get("shape"):
                body += ["    @staticmethod", "    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str='auto'):",
                         f"        {SHAPES[spec['shape']]}"]
            layouts = spec.get("layouts")
            if view_construction and layouts != "absent":
                ret = "None" if layouts is None else "(" + "".join(f"KVCacheLayout.{n}, " for n in layouts) + ")"
                body = ["from vllm.v1.kv_cache_layout import KVCacheLayout", *body, "    @classmethod",
                        "    def supported_kv_cache_layouts(cls):", f"        return {ret}"]
            body.append("    pass")
        (pkg / "v1" / "attention" / "backends" / f"{module}.py").write_text("\n".join(body) + "\n")
    if registry:
        (pkg / "v1" / "attention" / "backends" / "registry.py").write_text(textwrap.dedent('''
            import enum, importlib

            class AttentionBackendEnum(enum.Enum):
            {members}
                def get_class(self):
                    module, _, cls = self.value.rpartition(".")
                    return getattr(importlib.import_module(module), cls)
            ''').format(members="\n".join(members) or "    NONE = 'x.y'"))
    if view_construction:
        (pkg / "v1" / "kv_cache_interface.py").write_text(VIEW_CONSTRUCTION)
        (pkg / "v1" / "kv_cache_layout.py").write_text(KV_CACHE_LAYOUT)
        (pkg / "v1" / "attention" / "backends" / "utils.py").write_text(RESOLVER)
    return root
