"""compat.patches: every class-level patch is recorded and undone in order, never clobbering a
value someone else set later; post-import hooks fire once, on vLLM's own import."""

from __future__ import annotations

import importlib
import sys

import pytest

import compat
from compat import patches


@pytest.fixture(autouse=True)
def clean():
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


class Base:
    def method(self):
        return "base"


def test_patches_undo_newest_first_to_what_the_class_itself_held():
    class Child(Base):
        def own(self):
            return "own"

    own = vars(Child)["own"]
    patches.set_class_attr(Child, "method", lambda self: "first", scope="layers")  # inherited before
    patches.set_class_attr(Child, "method", lambda self: "second", scope="layers")  # a wrapper of the wrapper
    patches.set_class_attr(Child, "own", lambda self: "patched", scope="hook")
    assert (Child().method(), Child().own()) == ("second", "patched") and patches.patched(Child, "own")
    assert patches.undo_all("layers") == 2
    assert "method" not in vars(Child) and Child().method() == "base" and Child().own() == "patched"
    assert patches.undo_all() == 1 and vars(Child)["own"] is own and not patches.patched(Child, "own")


def test_a_value_set_by_someone_else_since_is_left_alone():
    class Other(Base):
        pass

    patches.set_class_attr(Other, "method", lambda self: "ours", scope="layers")
    theirs = lambda self: "theirs"  # noqa: E731
    Other.method = theirs
    assert patches.undo_all() == 0 and vars(Other)["method"] is theirs


def test_undo_callbacks_run_for_their_scope():
    seen = []
    patches.on_undo(lambda: seen.append("hook"), scope="hook")
    patches.on_undo(lambda: seen.append("layers"), scope="layers")
    patches.undo_all("layers")
    assert seen == ["layers"]
    patches.undo_all()
    assert seen == ["layers", "hook"]


def test_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="scope"):
        patches.set_class_attr(Base, "method", None, scope="everything")


def test_after_import_waits_for_the_import_and_fires_once(tmp_path, monkeypatch):
    name = "fake_vllm_patch_target"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    try:
        assert patches.after_import(name, lambda m: seen.append(m.VALUE), scope="hook") is False
        assert name not in sys.modules and seen == []
        module = importlib.import_module(name)
        assert seen == [1] and module.__loader__.get_source(name) == "VALUE = 1\n", "the real loader answers the rest"
        importlib.reload(module)
        assert patches.after_import(name, lambda m: seen.append("now"), scope="hook") is True
        assert seen[-1] == "now"
    finally:
        sys.modules.pop(name, None)
    patches.undo_all()
    assert not any(isinstance(f, type(patches._finder)) for f in sys.meta_path), "the finder leaves with its scope"
