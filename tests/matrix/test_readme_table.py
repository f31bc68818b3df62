"""README's "Supported vLLM releases" table is tests/matrix/expected_table.py, rendered.

Runs without vLLM (unit env). Every CUDA ``vllm==X`` row of EXPECTED must appear in README with
exactly what compat decided per backend and who writes the cache; every line from 0.15 to the newest
recorded one must be listed once; a line whose env is not in this tree yet is marked ``pending`` in every cell and must
have no EXPECTED row (so it cannot stay "pending" once recorded, nor be listed as proven before).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.matrix.expected_table import EXPECTED

README = Path(__file__).parents[2] / "README.md"
NEWEST = max(int(k.partition("==")[2].split(".")[1]) for k in EXPECTED if k.startswith("vllm=="))
LINES = [f"0.{minor}" for minor in range(15, NEWEST + 1)]
PENDING = "pending"


def render(row: dict[str, tuple]) -> list[str]:
    """README cells for one EXPECTED row: a layout per backend, then who writes the cache."""
    cells = []
    for backend in ("FLASHINFER", "FLASH_ATTN", "CPU_ATTN"):
        layout, source, _, _ = row[backend]
        if source is None:
            cells.append("not importable")
            continue
        text = layout if layout else "unknown (refused)"
        cells.append(text if source == "probe" else f"{text} ({source})")
    adapter = [b for b in ("FLASHINFER", "FLASH_ATTN", "CPU_ATTN") if row[b][2] == "adapter"]
    cells.append("vLLM" + (f"; {', '.join(adapter)}: sparse forward path" if adapter else ""))
    return cells


def readme_rows() -> dict[str, list[str]]:
    text = README.read_text()
    section = text.split("## Supported vLLM releases", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        # the version cell may carry a note in parentheses: a substituted pin (tools/add_release.py readme_note)
        m = re.match(r"\|\s*(0\.\d+\.\d+)(?:\s+\([^|]*\))?\s*\|(.*)\|\s*$", line)
        if m:
            assert m.group(1) not in rows, f"README lists {m.group(1)} twice"
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_every_line_is_listed_once():
    listed = [".".join(v.split(".")[:2]) for v in readme_rows()]
    assert sorted(listed, key=lambda v: int(v.split(".")[1])) == LINES, listed


@pytest.mark.parametrize("key", [k for k in EXPECTED if k.startswith("vllm==")])
def test_recorded_release_is_in_readme(key):
    version = key.partition("==")[2]
    rows = readme_rows()
    assert version in rows, f"README's release table lacks {version}; add: | {version} | {' | '.join(render(EXPECTED[key]))} |"
    assert rows[version] == render(EXPECTED[key]), f"README {version}: {rows[version]}; expected_table says {render(EXPECTED[key])}"


def test_pending_rows_are_not_recorded_yet():
    for version, cells in readme_rows().items():
        if PENDING in cells:
            assert all(c == PENDING for c in cells), f"{version}: mark every cell pending or none: {cells}"
            assert f"vllm=={version}" not in EXPECTED, f"{version} is recorded in expected_table.py: replace its pending README row"
        else:
            assert f"vllm=={version}" in EXPECTED, f"README lists {version} as proven but expected_table.py has no row"
