"""The Triton kernels compile for Hopper (sm_90) without a GPU.

The interpreter tests run the kernels' semantics but never Triton's compiler, so type
errors in the native 16-bit dot branch, block shapes ``tl.dot`` rejects or a shared
memory overflow would only show on a GPU.  Triton compiles ahead of time to a cubin for a
given target with its bundled ptxas, no device needed; this does that in a subprocess
(``TRITON_INTERPRET`` must be unset before triton is imported) for the launches the tile
table produces for the issue-13 shapes (32 / 8 heads, head size 128) and an fp32 one.
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
    import inspect, sys
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sparse_attn.kernels import triton_impl as ti

    def signature(fn, constexprs, ptrs):
        sig = {}
        for n in inspect.signature(fn.fn).parameters:
            sig[n] = "constexpr" if n in constexprs else ptrs.get(n, "fp32" if n == "scale" else "i32")
        return sig

    target = GPUTarget("cuda", 90, 32)
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    # (dtype, phase, group, block_m, counting): block_m as prepare() picks it
    for dtype, phase, group, block_m, count in [(torch.bfloat16, "decode", 4, 4, True),
                                                (torch.bfloat16, "prefill", 4, 64, False),
                                                (torch.float16, "decode", 8, 2, False),
                                                (torch.float32, "prefill", 4, 64, True)]:
        cfg = ti.tile_config(128, dtype, phase)
        hpp = min(cfg.heads_per_program, group)
        ce = dict(GROUP=group, HPP=hpp, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=max(block_m, 16 // hpp), BLOCK_N=64,
                  BLOCK_T=256 if count else 2, CAUSAL=True, COUNT=count, SPLIT=phase == "decode",
                  FP32_DOT=dtype == torch.float32)
        t = names[dtype]
        ptrs = {**{n: "*" + t for n in ("Q", "K", "V", "O")},
                **{n: "*fp32" for n in ("lam", "THRESH", "O_PART", "M_PART", "L_PART")},
                **{n: "*i32" for n in ("BT", "SEQ_LENS", "QSL", "TILE_SEQ", "TILE_ROW0", "SKIP_CNT", "VIS_CNT")}}
        k = triton.compile(ASTSource(ti._paged_attn_kernel, signature(ti._paged_attn_kernel, ce, ptrs), ce),
                           target=target, options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        assert k.asm["cubin"], "no cubin"
        print("compiled", t, phase, "shared", k.metadata.shared)
    ce = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=128)
    ptrs = {"O_PART": "*fp32", "M_PART": "*fp32", "L_PART": "*fp32", "O": "*bf16", "QSL": "*i32"}
    triton.compile(ASTSource(ti._merge_splits_kernel, signature(ti._merge_splits_kernel, ce, ptrs), ce),
                   target=target, options=dict(num_warps=4))
    print("compiled merge")
''')


def test_kernels_compile_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("triton's bundled ptxas is not available in this environment")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == 5, proc.stdout
    # Hopper allows at most 227 KiB of shared memory per block: above it the launch fails.
    for line in proc.stdout.splitlines():
        if "shared" in line:
            assert int(line.split()[-1]) <= 227 * 1024, line
