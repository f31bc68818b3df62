"""Two ``sparse-attn eval`` runs of the same prompts, paired: how far apart are their KLs against dense?

Two configurations of the plugin (e.g. two ``SPARSE_ATTN_CPU_ISA`` builds) scored by separate ``sparse-attn
eval`` runs with the same arguments (same seed, so the same prompts) each leave their engines' outputs in their
``--workdir``.  Each run's KL row is over its own prompts; their difference is far tighter paired prompt by
prompt, since most of the spread between prompts is the prompts'.  This reads both work directories and prints
each run's KL against its dense run (``kl_all``: every comparable generated and teacher-forced position, the
eval's headline, computed by ``sparse_attn.evaluation.metrics``), and the paired difference B - A with its 95 %
interval over prompts.  The two dense runs must have generated the same tokens (native vLLM is deterministic
on one machine): otherwise the runs are not paired and it stops.

    SPARSE_ATTN_CPU_ISA=avx512 sparse-attn eval CKPT --dtype bfloat16 --targets 0.5 ... --workdir WA
    sparse-attn eval CKPT --dtype bfloat16 --targets 0.5 ... --workdir WB
    python benchmarks/eval_paired.py WA WB --target 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparse_attn.evaluation.metrics import mean_ci, position_kls  # noqa: E402


def prompt_kls(dense: dict, sparse: dict) -> list[float]:
    """One KL per prompt: the mean over its comparable positions (the eval's ``kl_all``), in cell order."""
    out = []
    for dense_cell, cell in zip(dense["cells"], sparse["cells"]):
        for i in range(len(cell["text"])):
            _, kls = position_kls(cell, dense_cell, i, sparse.get("top_k"))
            pooled = kls["generated"] + kls["forced"]
            out.append(sum(pooled) / len(pooled) if pooled else float("nan"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("workdir_a", type=Path, help="the first run's --workdir (A)")
    p.add_argument("workdir_b", type=Path, help="the second run's --workdir (B)")
    p.add_argument("--target", default="0.5", help="the target both runs served (default 0.5)")
    a = p.parse_args(argv)
    runs = {}
    for name, workdir in (("A", a.workdir_a), ("B", a.workdir_b)):
        files = [workdir / "out-dense.json", workdir / f"out-target-{a.target}.json"]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            p.error(f"run {name}: {', '.join(missing)} not found; expected the --workdir of a finished "
                    f"`sparse-attn eval --targets {a.target}` run")
        runs[name] = [json.loads(f.read_text()) for f in files]
    (dense_a, sparse_a), (dense_b, sparse_b) = runs["A"], runs["B"]
    if [c["generated"] for c in dense_a["cells"]] != [c["generated"] for c in dense_b["cells"]]:
        p.error("the two dense runs generated different tokens: not the same prompts (same eval arguments and "
                "seed?) or not the same machine, so the runs cannot be paired")
    kl_a, kl_b = prompt_kls(dense_a, sparse_a), prompt_kls(dense_b, sparse_b)
    keep = [(x, y) for x, y in zip(kl_a, kl_b) if x == x and y == y]
    fmt = lambda m_ci: f"{m_ci[0]:.4f} +- {m_ci[1]:.4f}"
    print(f"prompts paired: {len(keep)} (of {len(kl_a)}); target {a.target}")
    print(f"KL(dense || sparse), nats, A: {fmt(mean_ci([x for x, _ in keep]))}")
    print(f"KL(dense || sparse), nats, B: {fmt(mean_ci([y for _, y in keep]))}")
    print(f"paired B - A: {fmt(mean_ci([y - x for x, y in keep]))} (95 % interval over prompts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
