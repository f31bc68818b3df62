#!/usr/bin/env python
"""Remove a tox env directory once its tests passed, when SPARSE_ATTN_PRUNE_PASSED_ENVS=1.

tox.ini runs this as the last command of each matrix env, so it only runs after pytest passed
(tox stops at the first failing command). .ci/run sets the variable: 19 import-level envs of
~1.5 GB each (the CUDA vllm wheel and its flashinfer pin are not shared) would otherwise stay on
disk together; pruned, the matrix holds one env plus uv's shared cache at a time. Without the
variable (local runs) the env is kept for fast reruns.

usage: python tools/prune_env.py ENV_DIR
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    env_dir = Path(argv[0]).resolve()
    if os.environ.get("SPARSE_ATTN_PRUNE_PASSED_ENVS") != "1":
        print(f"prune_env: keeping {env_dir} (set SPARSE_ATTN_PRUNE_PASSED_ENVS=1 to remove passed envs)")
        return 0
    if env_dir.parent.name != ".tox" and not (env_dir / "pyvenv.cfg").exists():
        print(f"prune_env: refusing to remove {env_dir}: not a tox env (no pyvenv.cfg, not under .tox/)", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in env_dir.rglob("*") if f.is_file() and not f.is_symlink())
    shutil.rmtree(env_dir)
    print(f"prune_env: removed {env_dir} ({size / 1e9:.2f} GB apparent; hardlinked files stay in uv's cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
