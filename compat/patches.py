"""The one registry of what compat changes in vLLM's classes, so each change can be undone.

Every class-level patch (the worker's ``load_model`` / ``execute_model`` hooks and RPC method,
a metadata builder's ``build`` capture and CUDA-graph declaration) goes through
``set_class_attr``, which records what the class held in its own ``__dict__`` before; every
post-import hook goes through ``after_import``. ``undo_all()`` restores them newest first (so a
wrapper of a wrapper unwinds in order) and is what ``compat.reset_for_tests()`` calls;
``undo_all(scope)`` undoes one scope only (``"layers"``: what ``install`` patched for the
layers it made sparse; ``"hook"``: what ``register`` patched in the worker).

Nothing here imports vLLM.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

_MISSING = object()
SCOPES = ("hook", "layers")


@dataclass
class _Patch:
    scope: str
    owner: type
    name: str
    previous: Any  # the owner's own __dict__ entry before, or _MISSING
    value: Any


_patches: list[_Patch] = []
#: (scope, undo callback) for state that is not a class attribute (module caches, import hooks).
_undo_callbacks: list[tuple[str, Callable[[], None]]] = []
_lock = threading.RLock()


def set_class_attr(owner: type, name: str, value: Any, *, scope: str) -> None:
    """``setattr(owner, name, value)``, recorded so ``undo_all`` restores what ``owner`` itself held."""
    if scope not in SCOPES:
        raise ValueError(f"scope {scope!r}: expected one of {SCOPES}")
    with _lock:
        _patches.append(_Patch(scope, owner, name, vars(owner).get(name, _MISSING), value))
        setattr(owner, name, value)


def on_undo(callback: Callable[[], None], *, scope: str) -> None:
    """Run ``callback`` when ``scope`` is undone (e.g. to forget a cache of what was patched)."""
    with _lock:
        _undo_callbacks.append((scope, callback))


def patched(owner: type, name: str) -> bool:
    """True while ``owner.name`` is a value this registry set and nobody replaced since."""
    with _lock:
        return any(p.owner is owner and p.name == name and vars(owner).get(name, _MISSING) is p.value
                   for p in _patches)


def undo_all(scope: str | None = None) -> int:
    """Restore every patch of ``scope`` (all scopes when ``None``), newest first; returns how many.

    A patch whose attribute was replaced by someone else since is left alone (restoring it
    would drop their value)."""
    with _lock:
        undone = 0
        for patch in reversed(list(_patches)):
            if scope is not None and patch.scope != scope:
                continue
            _patches.remove(patch)
            if vars(patch.owner).get(patch.name, _MISSING) is not patch.value:
                continue
            if patch.previous is _MISSING:
                delattr(patch.owner, patch.name)
            else:
                setattr(patch.owner, patch.name, patch.previous)
            undone += 1
        for entry in reversed(list(_undo_callbacks)):
            if scope is None or entry[0] == scope:
                _undo_callbacks.remove(entry)
                entry[1]()
        return undone


# --------------------------------------------------------------------------- post-import hooks
class _AfterImportLoader(importlib.abc.Loader):
    """Runs the real loader, then the callbacks waiting for this module."""

    def __init__(self, loader: importlib.abc.Loader, callbacks: list[Callable[[ModuleType], None]]):
        self._loader, self._callbacks = loader, callbacks

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for callback in list(self._callbacks):
            callback(module)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` while some module has callbacks waiting for its import."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, fullname, path, target=None):
        callbacks = self.waiting.get(fullname)
        if not callbacks:
            return None
        spec = None
        for finder in sys.meta_path:  # whoever would have found it (path finder, an editable install's)
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # nothing to wrap: the import proceeds (or fails) exactly as without us
        del self.waiting[fullname]
        spec.loader = _AfterImportLoader(spec.loader, callbacks)
        return spec


_finder = _AfterImportFinder()


def after_import(module_name: str, callback: Callable[[ModuleType], None], *, scope: str) -> bool:
    """Call ``callback(module)`` once ``module_name`` is imported: now when it already is (returns
    True), else right after vLLM imports it (returns False), so a process that never imports the
    module (vLLM's API server never imports the GPU worker) pays nothing and imports nothing."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return True
    with _lock:
        _finder.waiting.setdefault(module_name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
            on_undo(_remove_finder, scope=scope)
    return False


def _remove_finder() -> None:
    _finder.waiting.clear()
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
