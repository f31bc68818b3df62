"""The Triton kernels compile for Hopper (sm_90) without a GPU.

The interpreter tests run the kernels' semantics but never Triton's compiler, so type
errors in the native 16-bit dot branch, fp8 loads, block shapes ``tl.dot`` rejects or a
shared memory overflow would only show on a GPU.  Triton compiles ahead of time to a cubin
for a given target with its bundled ptxas, no device needed; this does that in a
subprocess (``TRITON_INTERPRET`` must be unset before triton is imported) for exactly the
launches :func:`triton_impl.prepare` builds (run on meta tensors, so the grid, the tile
table row and every constexpr are the real ones) for head sizes 64, 128 and 256 and the
layer features real models have: Llama-style GQA, Gemma 3 (head 256, a 512-token window),
gpt-oss (head 64, sinks, a 128-token window, here with an fp8 e4m3 cache and device
scales) and a Gemma 2-like soft-capped layer on an fp8 e5m2 cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

SCRIPT = textwrap.dedent('''
    import inspect
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sparse_attn.kernels import BatchMeta, LambdaRule, LayerSpec, PagedBatch
    from sparse_attn.kernels import triton_impl as ti

    TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
             torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
    META = dict(device="meta")

    def plan(dtype, kv_dtype, hq, hkv, d, kv_lens, q_lens, spec_kw, counting):
        page, t = 16, sum(q_lens)
        blocks = max(kv_lens) // page + 1
        kv = torch.empty(len(kv_lens) * blocks, hkv, page, 2 * d, dtype=kv_dtype, **META).transpose(1, 2)
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        batch = PagedBatch(torch.empty(t, hq, d, dtype=dtype, **META), kv[..., :d], kv[..., d:],
                           torch.empty(len(kv_lens), blocks, dtype=torch.int32, **META),
                           torch.empty(len(kv_lens), dtype=torch.int32, **META),
                           torch.empty(len(kv_lens) + 1, dtype=torch.int32, **META),
                           host=BatchMeta.from_host(kv_lens, qsl))
        spec_kw = dict(spec_kw)
        for name in ("sink_logits", "k_scale", "v_scale"):
            if spec_kw.get(name) == "tensor":
                spec_kw[name] = torch.empty(hq if name == "sink_logits" else 1, dtype=torch.float32, **META)
        n = len(kv_lens)
        if counting == "served":   # the serving launch: lambdas (float64) and atomic counts in the kernel
            return ti.prepare(batch, LayerSpec(d ** -0.5, **spec_kw), batch.host, threshold=LambdaRule(35.3, 4096),
                              count_thresholds=None, out=torch.empty(t, hq, d, dtype=dtype, **META),
                              counters=torch.empty(5, dtype=torch.int64, **META))
        return ti.prepare(batch, LayerSpec(d ** -0.5, **spec_kw), batch.host,
                          threshold=torch.empty(n, dtype=torch.float32, **META),
                          count_thresholds=torch.empty(3, n, dtype=torch.float32, **META) if counting else None,
                          out=torch.empty(t, hq, d, dtype=dtype, **META))

    def compile_call(call):
        names = list(inspect.signature(call.kernel.fn).parameters)
        ce = {k: v for k, v in call.constexprs.items() if k in names}
        sig = {}
        for name, arg in zip([n for n in names if n not in ce], call.args):
            if isinstance(arg, torch.Tensor):
                sig[name] = "*" + TYPES[arg.dtype]
            else:
                sig[name] = "fp32" if isinstance(arg, float) else "i32"
        sig.update({n: "constexpr" for n in ce})
        opts = {k: call.constexprs[k] for k in ("num_warps", "num_stages") if k in call.constexprs}
        return triton.compile(ASTSource(call.kernel, sig, ce), target=GPUTarget("cuda", 90, 32), options=opts)

    BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
    E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
    CASES = [
        # name, dtype, kv dtype, Hq, Hkv, D, kv_lens, q_lens, spec, counting
        ("llama-decode-split", BF16, BF16, 32, 8, 128, [32768], [1], {}, True),
        ("llama-prefill", BF16, BF16, 32, 8, 128, [4096], [4096], {}, False),
        ("llama-decode-batch256", F16, F16, 64, 8, 128, [8192] * 256, [1] * 256, {}, False),
        ("llama-prefill-fp32", F32, F32, 32, 8, 128, [2048], [2048], {}, True),
        ("gemma3-decode-window", BF16, BF16, 4, 1, 256, [32768], [1], dict(window=512), True),
        ("gemma3-prefill-window", BF16, BF16, 4, 1, 256, [8192], [8192], dict(window=512), False),
        ("gptoss-decode-fp8", BF16, E4M3, 64, 8, 64, [16384], [1],
         dict(window=128, sink_logits="tensor", k_scale="tensor", v_scale="tensor"), True),
        ("gptoss-prefill-fp8", BF16, E4M3, 64, 8, 64, [4096], [4096],
         dict(sink_logits="tensor", k_scale="tensor", v_scale="tensor"), False),
        ("softcap-prefill-e5m2", F16, E5M2, 8, 4, 256, [4096], [512], dict(soft_cap=50.0, k_scale=0.5), False),
        ("llama-decode-split-served", BF16, BF16, 32, 8, 128, [32768], [1], {}, "served"),
        ("gemma3-prefill-window-served", BF16, BF16, 4, 1, 256, [8192], [8192], dict(window=512), "served"),
    ]
    for name, *args in CASES:
        p = plan(*args)
        for call in p.calls:
            k = compile_call(call)
            assert k.asm["cubin"], "no cubin"
            print("compiled", name, call.kernel.fn.__name__, "grid", call.grid, "shared", k.metadata.shared)
    print("cases", len(CASES))
''')


def test_kernels_compile_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900, env=env,
                          cwd=ROOT)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("triton's bundled ptxas is not available in this environment")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    compiled = [line for line in lines if line.startswith("compiled")]
    assert lines[-1] == "cases 11" and len({line.split()[1] for line in compiled}) == 11, proc.stdout
    # The split-KV decodes launch the merge kernel too; the others do not.
    merged = {line.split()[1] for line in compiled if "merge_splits_kernel" in line}
    assert merged == {"llama-decode-split", "gemma3-decode-window", "gptoss-decode-fp8", "llama-decode-split-served"}, \
        proc.stdout
    # Hopper allows at most 227 KiB of shared memory per block: above it the launch fails.
    for line in compiled:
        assert int(line.split()[-1]) <= 227 * 1024, line
