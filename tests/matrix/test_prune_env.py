"""tools/prune_env.py: removes a passed tox env only when CI asks, and only a venv."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "tools" / "prune_env.py"


def run(env_dir, prune):
    env = {"PATH": "/usr/bin:/bin", **({"SPARSE_ATTN_PRUNE_PASSED_ENVS": "1"} if prune else {})}
    return subprocess.run([sys.executable, str(SCRIPT), str(env_dir)], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("prune", [pytest.param(False, id="local-run-keeps"), pytest.param(True, id="ci-removes")])
def test_prune_only_when_asked(tmp_path, prune):
    env_dir = tmp_path / "vllm0320"
    (env_dir / "lib").mkdir(parents=True)
    (env_dir / "pyvenv.cfg").write_text("home = /usr\n")
    (env_dir / "lib" / "big.bin").write_bytes(b"x" * 1000)
    done = run(env_dir, prune)
    assert done.returncode == 0, done.stderr
    assert env_dir.exists() is not prune


def test_refuses_a_directory_that_is_not_a_venv(tmp_path):
    other = tmp_path / "src"
    other.mkdir()
    (other / "keep.py").write_text("")
    done = run(other, True)
    assert done.returncode == 2 and "not a tox env" in done.stderr
    assert (other / "keep.py").exists()
