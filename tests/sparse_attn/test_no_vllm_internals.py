"""``sparse_attn/`` names no vLLM internals: every vLLM attribute, engine keyword,
server flag, ``VLLM_*`` variable and RPC route is a ``compat`` call.

An AST scan (not a grep: comments and prose may mention vLLM freely) of every
module under ``sparse_attn/``; the self-test below shows the scan catches each kind.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sparse_attn"

#: Attributes of vLLM layers, impls, metadata, workers and backends (compat.model / compat.worker read them).
VLLM_ATTRIBUTES = frozenset({
    "attn_backend", "impl", "kv_sharing_target_layer_name", "model_runner", "vllm_config", "model_config",
    "get_builder_cls", "get_name", "block_table_tensor", "num_actual_tokens", "forward_includes_kv_cache_update",
    "do_kv_cache_update", "get_kv_cache_shape", "use_cascade", "sliding_window", "logits_soft_cap", "alibi_slopes",
    "sinks", "use_mla", "attn_type", "isa", "get_model", "load_model", "get_cudagraph_support", "_cudagraph_support",
})
#: vLLM engine keyword names and impl-forward keywords (compat.launch / compat.worker own them).
VLLM_KEYWORDS = frozenset({
    "enforce_eager", "enable_prefix_caching", "max_num_batched_tokens", "kv_cache_memory_bytes", "attention_backend",
    "gpu_memory_utilization", "output_scale", "output_block_scale",
})
#: Substrings no string literal may contain: vLLM variables, server-only flags, dev-mode RPC routes.
VLLM_STRINGS = ("VLLM_", "/collective_rpc", "--enforce-eager", "--served-model-name", "--enable-prefix-caching",
                "--no-enable-prefix-caching", "--kv-cache-memory")


def _reads_layer_features(node: ast.Attribute) -> bool:
    """``features.sliding_window`` / ``info.features.logits_soft_cap``: a field of compat's
    ``LayerFeatures``, whose names match vLLM's on purpose but hold compat's normalised values."""
    receiver = node.value
    return (isinstance(receiver, ast.Name) and receiver.id == "features") or (
        isinstance(receiver, ast.Attribute) and receiver.attr == "features")


def violations(source: str, filename: str = "<source>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and node.attr in VLLM_ATTRIBUTES and not _reads_layer_features(node):
            found.append(f"{where}: attribute .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg in VLLM_KEYWORDS:
            found.append(f"{where}: keyword {node.arg}=")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in VLLM_ATTRIBUTES | VLLM_KEYWORDS:
                found.append(f"{where}: string {node.value!r}")
            found += [f"{where}: string containing {s!r}" for s in VLLM_STRINGS if s in node.value]
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_module_names_no_vllm_internals(path):
    assert violations(path.read_text(), str(path.relative_to(PACKAGE.parent))) == []


@pytest.mark.parametrize("snippet, kind", [
    pytest.param("backend = layer.attn_backend.get_name()", "attribute .attn_backend", id="layer-attribute"),
    pytest.param("getattr(layer, 'kv_sharing_target_layer_name', None)", "string 'kv_sharing_target_layer_name'", id="getattr"),
    pytest.param("LLM(model=m, enforce_eager=True)", "keyword enforce_eager=", id="engine-keyword"),
    pytest.param("kwargs['kv_cache_memory_bytes'] = 1", "string 'kv_cache_memory_bytes'", id="engine-keyword-key"),
    pytest.param("env['VLLM_CPU_KVCACHE_SPACE'] = '1'", "containing 'VLLM_'", id="vllm-variable"),
    pytest.param("post('/collective_rpc')", "containing '/collective_rpc'", id="rpc-route"),
    pytest.param("args = ['--enforce-eager']", "containing '--enforce-eager'", id="server-flag"),
    pytest.param("impl.forward(*a, output_scale=None)", "keyword output_scale=", id="forward-keyword"),
])
def test_the_scan_catches_each_kind(snippet, kind):
    assert any(kind in v for v in violations(snippet)), violations(snippet)


@pytest.mark.parametrize("snippet, found", [
    pytest.param("w = info.features.sliding_window", False, id="layer-features-field"),
    pytest.param("w = features.logits_soft_cap", False, id="features-argument"),
    pytest.param("w = layer.impl.sliding_window", True, id="impl-attribute-still-caught"),
])
def test_layer_features_fields_are_compat_names(snippet, found):
    assert bool(violations(snippet)) is found, violations(snippet)
