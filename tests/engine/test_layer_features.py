"""Layers real models have, served sparse on a real vLLM engine (vllm-cpu 0.32: its CPU_ATTN
serves sliding windows, soft-cap and sinks natively, so native vLLM is the reference).

One driver process per model serves the native checkpoint and then the sparse-configured copy at
a tiny lambda (``1e-30 * e^0.5 / kv_len``: a tile is skipped only ~75 nats below its seed), so the tokens must be
identical and every layer must run sparse; the install summary says which features each sparse
layer uses. The checkpoints are small random ones shaped like each family
(tests/engine/feature_models.py), and Gemma-3-270M itself (marked ``gemma``: its conversion
takes minutes, so CI leaves it out: ``tools/tox -e real0320 -- -m gemma``).

Cost: two engine starts per model (~80-110 s each on 2 cores), so like tests/engine/test_real_model.py
they run where the models extra is installed: tox env real0320 installs it, engine0320 and engine0280 do
not and skip before any engine starts (one run per CI). A vLLM whose CPU attention op takes no window /
soft-cap / sinks arguments cannot be the reference and skips too.
SmolLM2-135M-Instruct with ``kv_cache_dtype="fp8"``: 30/30 layers sparse, token-identical to native
vLLM's fp8 cache (both read the bytes vLLM's own writer stored). vllm-cpu stores fp8 caches only on
x86 with AVX-512 or AMX: where the CPU has either that test is required (it fails rather than skip);
on an AVX2-only machine it skips and says so (three engine starts, ~3 min).
A random Gemma 3 at a real lambda (~0.3): decode tiles skipped, logprobs within a bound of native.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sparse_attn.demo.server import phase_totals
from tests.engine.conftest import HERE, engine_env, skip_softmax_section
from tests.vllm_cpu import fp8_cache_cpu_flags, fp8_cache_refusal

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
    # CI budget: one run per CI, in the env that has the models extra (real0320), as test_real_model.py
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
                       reason="engine tests of model families run where the models extra is installed "
                              "(tox env real0320; engine0320 and engine0280 skip them: one run per CI)"),
]

#: family -> (owner class the checkpoint targets, expected sparse_features of the install summary)
FAMILIES = {
    "gemma3": ("Gemma3Attention", {"sliding_window=64": 5, "none": 1}),
    "gemma2": ("Gemma2Attention", {"sliding_window=64, logits_soft_cap=50.0": 2, "logits_soft_cap=50.0": 2}),
    "gpt_oss": ("OAIAttention", {"sliding_window=32, has_sinks=True": 2, "has_sinks=True": 2}),
}
#: Gemma-3-270M: 15 layers with a 512-token window, 3 global; prompts longer than the window.
GEMMA_270M = ("Gemma3Attention", {"sliding_window=512": 15, "none": 3})
GEMMA_PROMPT_LEN = 700


def _native_reference_missing() -> str | None:
    """Why this vLLM's CPU attention cannot be the reference for these layers, or None."""
    import compat

    try:
        ops = compat.cpu_ops()  # vllm._custom_ops up to 0.33, vllm._cpu_ops from 0.34
    except Exception as exc:  # noqa: BLE001
        return f"vLLM's CPU ops are not importable: {exc}"
    wanted = {"sliding_window", "softcap", "s_aux"}
    have = set(inspect.signature(getattr(ops, "cpu_attention_with_kv_cache", lambda: None)).parameters)
    if not wanted <= have:
        return (f"this vLLM's CPU attention op takes no {sorted(wanted - have)} argument(s): native vLLM cannot "
                "serve windows / soft-cap / sinks on CPU to compare with (vllm-cpu 0.27-0.32 can)")
    return None


def _serve(tmp_path: Path, native: Path, owner: str, prompt_len: int | None = None,
           kv_cache_dtype: str = "auto", scales: tuple[float, float] | None = None,
           dtype: str = "float32") -> tuple[dict, dict]:
    """Serve ``native`` and a copy configured sparse for ``owner`` layers; both reports.
    ``scales``: the (global, window) scale factors at the target; default a tiny lambda."""
    sparse = tmp_path / f"{native.name}-sparse"
    sparse.mkdir()
    for item in native.iterdir():  # weights symlinked: Gemma-3-270M's are 1 GB
        if item.name != "config.json":
            (sparse / item.name).symlink_to(item.resolve())
    config = json.loads((native / "config.json").read_text())
    # 1e-30, not the 1e-9 of the other engine tests: Gemma-3-270M's windowed decode, anchored on its
    # diagonal tile, has tiles 27+ nats below it, which 1e-9 * e^0.5 / kv_len (~2e-12) skips (2 of
    # 30288, measured); the fp32 ratios reach 1e-33 without underflow.
    # Windowed layers are served on the window curve (lambda = scale / min(kv_len, w)), as a
    # calibrated checkpoint of a model with windows has it.
    if scales is None:
        section = skip_softmax_section((1e-30, 1.0), (1e-30, 1.0), window=(1e-30, 1.0))
    else:  # a = scale / e^(b * target): the curve gives exactly these scales at the target 0.5
        (global_scale, window_scale), b = scales, 1.0
        curve = lambda scale: (scale / math.exp(b * 0.5), b)  # noqa: E731
        section = skip_softmax_section(curve(global_scale), curve(global_scale), target=0.5, window=curve(window_scale))
    section["config_groups"]["group_0"]["targets"] = [owner]
    config["sparse_attention_config"] = section
    (sparse / "config.json").write_text(json.dumps(config, indent=1))
    out = tmp_path / "reports.json"
    cmd = [sys.executable, str(HERE / "feature_driver.py"), str(out), str(native), str(sparse)]
    if prompt_len:
        cmd += ["--prompt-len", str(prompt_len)]
    cmd += ["--kv-cache-dtype", kv_cache_dtype, "--dtype", dtype]
    proc = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    reports = json.loads(out.read_text())
    return reports[str(native)], reports[str(sparse)]


def _serve_native(tmp_path: Path, ckpt: Path, kv_cache_dtype: str, dtype: str = "float32") -> tuple[dict]:
    """``ckpt`` served natively (the plugin disabled) with ``kv_cache_dtype`` in ``dtype``: its report."""
    out = tmp_path / f"native-{kv_cache_dtype}-{dtype}.json"
    cmd = [sys.executable, str(HERE / "feature_driver.py"), str(out), str(ckpt), "--kv-cache-dtype", kv_cache_dtype,
           "--dtype", dtype]
    proc = subprocess.run(cmd, env=engine_env(SPARSE_ATTN_DISABLE="1"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    (report,) = json.loads(out.read_text()).values()
    assert "error" not in report, report["error"]
    return (report,)


def _assert_gap_within(name: str, ours: tuple[str, dict, dict], yardstick: tuple[str, dict, dict], factor: float,
                       keys: tuple[str, ...] = ("prompt_logprobs", "logprobs")) -> None:
    """Mean |logprob| gap of ``ours`` (label, report, report) < ``factor`` x that of ``yardstick``, over the
    prompt tokens and (by default) the generated ones alike."""
    for key in keys:
        gaps = {label: _logprob_gaps(a, b, key) for label, a, b in (ours, yardstick)}
        means = {label: sum(g) / len(g) for label, g in gaps.items()}
        print(f"{name} {key}: " + "; ".join(f"|{label}| mean {means[label]:.3f} max {max(gaps[label]):.3f}" for label in gaps))
        assert means[ours[0]] < factor * means[yardstick[0]], (key, means)


def _assert_sparse_and_identical(name: str, native: dict, sparse: dict, features: dict, logprob_tolerance: float = 1e-3) -> None:
    _assert_all_sparse(native, sparse, features)
    assert sparse["tokens"] == native["tokens"]
    # Random checkpoints repeat their greedy tokens, so the logprob of every prompt token (prefill
    # attention at each position) and generated token (decode) is compared too: the sparse kernel at
    # a tiny lambda is dense attention in another summation order, within fp32 rounding of native.
    for key in ("prompt_logprobs", "logprobs"):
        worst = max(_logprob_gaps(sparse, native, key))
        print(f"{name} {key}: max |sparse - native| = {worst:.2e}")
        assert worst < logprob_tolerance, (key, worst)


def _assert_all_sparse(native: dict, sparse: dict, features: dict) -> None:
    assert "error" not in native and "error" not in sparse, (native.get("error"), sparse.get("error"))
    (install,) = [s["install"] for s in sparse["stats"]]
    assert install["native"] == {} and install["installed"] == install["total"], install
    assert install["sparse_features"] == features, install["sparse_features"]
    assert install["lambda"] == _expected_lambda(features), install["lambda"]
    for phase in ("prefill", "decode"):
        totals = phase_totals(sparse["stats"], phase)
        assert totals["launches"] > 0 and totals["native_launches"] == 0 and totals["skipped"] == 0, (phase, totals)


def _expected_lambda(features: dict) -> dict:
    """The install summary's ``lambda`` for these features: windowed layers on the window curve."""
    expected: dict = {}
    for used, n in features.items():
        window = next((part.split("=")[1] for part in used.split(", ") if part.startswith("sliding_window=")), None)
        rule = f"scale_window / min(kv_len, {window})" if window else "scale / kv_len"
        expected[rule] = expected.get(rule, 0) + n
    return expected


def _logprob_gaps(a: dict, b: dict, key: str) -> list[float]:
    """|a - b| of every prompt (``prompt_logprobs``) or generated (``logprobs``) token's logprob."""
    return [abs(x - y) for xs, ys in zip(a[key], b[key]) for x, y in zip(xs, ys)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_layer_serves_sparse_and_token_identical_to_native(family, tmp_path):
    why = _native_reference_missing()
    if why:
        pytest.skip(why)
    from tests.engine.feature_models import build

    owner, features = FAMILIES[family]
    native, sparse = _serve(tmp_path, build(family, tmp_path / family), owner)
    _assert_sparse_and_identical(family, native, sparse, features)


@pytest.mark.gemma
def test_gemma_3_270m_serves_18_of_18_layers_sparse_token_identical_to_native(tmp_path):
    why = _native_reference_missing()
    if why:
        pytest.skip(why)
    from sparse_attn import models

    # the default directory: a verified conversion is reused, otherwise made once (minutes)
    ckpt = models.install_model("gemma-3-270m", models.default_dir("gemma-3-270m"), say=lambda s: None)
    owner, features = GEMMA_270M
    native, sparse = _serve(tmp_path, ckpt, owner, prompt_len=GEMMA_PROMPT_LEN)
    _assert_sparse_and_identical("gemma-3-270m", native, sparse, features)


#: A real lambda on the random Gemma 3 (5 layers with a 64-token window, 1 global; prompts of 281-301 tokens):
#: 0.3 on the windowed layers' curve (scale 0.3 * 64 over min(kv_len, 64)) and ~0.3 on the global one (scale
#: 90 over kv_len). Decode skips tiles there (measured: 209 of 2700 decode tiles, and 6 at lambda 0.05);
#: prefill, whose 64-row query tiles keep a KV tile when any row does, skips none on this random model.
REAL_LAMBDA_SCALES = (0.3 * 300, 0.3 * 64)
#: |sparse - native| logprob of the generated tokens, in nats. A bound, not a measurement: at lambda 0.3 a
#: skipped tile's every weight is below 0.3 x its row's running max, measured mean 0.017 and max 0.073 nats
#: over 48 tokens (twice, identical); the bound, ~3x that, leaves room for another machine's summation order.
REAL_LAMBDA_LOGPROB_MEAN, REAL_LAMBDA_LOGPROB_MAX = 0.05, 0.25


def test_gemma3_at_a_real_lambda_skips_decode_tiles_within_a_logprob_bound_of_native(tmp_path):
    """The feature tests above run at a tiny lambda: they prove windows are served dense-equivalent, not
    that skipping works in an engine. This one skips decode tiles (the stats RPC) and stays close to native."""
    why = _native_reference_missing()
    if why:
        pytest.skip(why)
    from tests.engine.feature_models import build

    owner, features = FAMILIES["gemma3"]
    native, sparse = _serve(tmp_path, build("gemma3", tmp_path / "gemma3"), owner, scales=REAL_LAMBDA_SCALES)
    assert "error" not in native and "error" not in sparse, (native.get("error"), sparse.get("error"))
    (install,) = [s["install"] for s in sparse["stats"]]
    assert install["installed"] == install["total"] == 6 and install["sparse_features"] == features, install
    assert install["lambda"] == _expected_lambda(features) and install["window_curve_never_skips"] == {}, install
    decode = phase_totals(sparse["stats"], "decode")
    prefill = phase_totals(sparse["stats"], "prefill")
    print(f"gemma3 at lambda ~0.3: decode {decode}, prefill {prefill}")
    assert decode["native_launches"] == 0 and prefill["native_launches"] == 0, (decode, prefill)
    # at least 1 % of the decode tiles skipped (the stats RPC's counters of exactly these batches)
    assert decode["visited"] > 0 and decode["skipped"] >= 0.01 * decode["visited"], decode
    gaps = _logprob_gaps(sparse, native, "logprobs")
    mean = sum(gaps) / len(gaps)
    print(f"gemma3 at lambda ~0.3 logprobs: |sparse - native| mean {mean:.4f} max {max(gaps):.4f} over {len(gaps)}")
    assert mean < REAL_LAMBDA_LOGPROB_MEAN and max(gaps) < REAL_LAMBDA_LOGPROB_MAX, (mean, max(gaps))
    # prefill attention is the dense one wherever it skipped nothing: prompt logprobs within fp32 rounding
    if prefill["skipped"] == 0:
        assert max(_logprob_gaps(sparse, native, "prompt_logprobs")) < 1e-3


#: SmolLM2-135M-Instruct: 30 Llama layers, full attention; with an fp8 cache each uses only that feature.
SMOLLM2_FP8 = ("LlamaAttention", {"kv_cache_dtype=fp8_e4m3": 30})


def test_smollm2_with_an_fp8_kv_cache_serves_30_of_30_layers_sparse_token_identical_to_native(tmp_path):
    # Required where the hardware exists: a CPU whose flags have AVX-512 or AMX fails here instead of
    # skipping (a skip there would hide a broken fp8 path behind a green run); elsewhere it skips, saying why.
    required = fp8_cache_cpu_flags()
    why = _native_reference_missing() or fp8_cache_refusal()
    if why and required:
        pytest.fail(f"{why}; but this CPU has {', '.join(required)} (/proc/cpuinfo), where vLLM stores fp8 KV caches, "
                    "so this test is required here and may not skip")
    if why:
        pytest.skip(f"{why}, so native vLLM cannot be the reference")
    from sparse_attn import models

    # the default directory: a verified conversion is reused, otherwise made once (~35 s)
    ckpt = models.install_model("smollm2-135m-instruct", models.default_dir("smollm2-135m-instruct"), say=lambda s: None)
    owner, features = SMOLLM2_FP8
    native, sparse = _serve(tmp_path, ckpt, owner, kv_cache_dtype="fp8")
    _assert_all_sparse(native, sparse, features)
    assert sparse["tokens"] == native["tokens"]
    # Not within fp32 rounding of native, by construction: every layer's K/V are rounded to fp8 (vLLM's
    # writer truncates), so a 1e-7 difference in a layer's output (another summation order) moves the
    # next layer's K/V elements that sit at a code boundary by a whole fp8 step (12.5 %). Measured in
    # one engine, each sparse layer call equals native's on the same cache within 7e-6 (480 calls).
    # The yardstick is the fp8 cache's own effect: the same prompts served natively with an
    # unquantised cache. Sparse must stay well inside it.
    (unquantised,) = _serve_native(tmp_path, ckpt, "auto")
    _assert_gap_within("smollm2-fp8", ("sparse", sparse, native), ("native fp8 - unquantised", native, unquantised), 0.5)


#: SmolLM2-135M-Instruct in bfloat16: 30 Llama layers, full attention, no other feature.
SMOLLM2_BF16 = ("LlamaAttention", {"none": 30})


def test_smollm2_in_bfloat16_serves_30_of_30_layers_sparse_as_close_to_fp32_as_native_bf16(tmp_path):
    """bfloat16, vLLM's default dtype for most checkpoints. On a CPU with AMX vLLM packs bf16 pages for its
    AMX kernel, which compat cannot read; compat makes the sparse layers' builder pick vLLM's ``vec`` pages
    instead (``compat.model.readable_cpu_pages``), so here every layer must run sparse, on every CPU."""
    why = _native_reference_missing()
    if why:
        pytest.skip(why)
    from sparse_attn import models

    ckpt = models.install_model("smollm2-135m-instruct", models.default_dir("smollm2-135m-instruct"), say=lambda s: None)
    owner, features = SMOLLM2_BF16
    native, sparse = _serve(tmp_path, ckpt, owner, dtype="bfloat16")
    _assert_all_sparse(native, sparse, features)
    # Not within fp32 rounding of native: vLLM's bf16 kernels (AMX tiles where the CPU has them) round the
    # probabilities to bf16 before P.V, ours accumulates P.V in fp32, and every layer's bf16 output moves the
    # next layer's K/V by a bf16 step, so the two bf16 engines differ from each other about as much as either
    # differs from fp32 (measured on an AMX Xeon: 0.084 nats mean over the prompt tokens between them). The
    # independent reference is the same prompts served natively in float32: over every prompt token (the same
    # tokens in all three engines: paired), sparse bf16 must be as close to it as native bf16 is (measured twice:
    # 0.070 vs 0.071 and 0.070 vs 0.072 nats over 870 prompt tokens); 1.25x leaves room for another CPU's rounding,
    # and a broken page read or a wrong dtype is far outside it. Not over the generated tokens: the three greedy
    # paths part after a few tokens, from where the logprobs are of different tokens (and native bf16's, whose AMX
    # kernel is not run-to-run deterministic, measured 0.82 then 0.41 nats from fp32 over the same 48 steps).
    (fp32,) = _serve_native(tmp_path, ckpt, "auto", "float32")
    _assert_gap_within("smollm2-bf16", ("sparse bf16 - fp32", sparse, fp32), ("native bf16 - fp32", native, fp32), 1.25,
                       keys=("prompt_logprobs",))
