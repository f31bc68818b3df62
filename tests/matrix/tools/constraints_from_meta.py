"""Print a uv constraints file from a vllm wheel: its Requires-Dist (no extras, no torch family) for py3.11/x86_64 Linux.

usage: python constraints_from_meta.py vllm-VER-*.whl > constraints.txt
(tools/add-release imports ``wheel_constraints`` and ``wheel_requirements``.)
"""
from __future__ import annotations

import sys
import zipfile

from packaging.requirements import Requirement

TORCH_FAMILY = {"torch", "torchaudio", "torchvision", "torchcodec"}
MARKER_ENV = {"python_version": "3.11", "platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux"}


def wheel_requirements(whl: str) -> list[Requirement]:
    """The wheel's unconditional Requires-Dist that apply on py3.11 / x86_64 Linux."""
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    found = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        r = Requirement(line[len("Requires-Dist: "):])
        if r.marker and "extra" in str(r.marker):
            continue
        if r.marker and not r.marker.evaluate(MARKER_ENV):
            continue
        found.append(r)
    return found


def wheel_constraints(whl: str) -> list[str]:
    """``name<spec>`` lines for every versioned requirement outside the torch family."""
    return [f"{r.name}{r.specifier}" for r in wheel_requirements(whl) if r.name.lower() not in TORCH_FAMILY and str(r.specifier)]


if __name__ == "__main__":
    print("\n".join(wheel_constraints(sys.argv[1])))
