"""compat.worker against fakes (no vLLM): the model-load hook, the worker RPC,
the impl forward-call normaliser and impl replacement.

That the real worker class and impl signatures are what these fakes model is
proven per release by the tox matrix (tests/matrix/test_contract.py).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import compat
from compat import worker
from compat.errors import HookError, ImplReplacementError


@pytest.fixture(autouse=True)
def clean_patches():
    compat.reset_for_tests()  # every test starts with no hook and no patch
    yield
    compat.reset_for_tests()


@pytest.fixture
def fake_worker_class(monkeypatch):
    """A fresh ``Worker`` class in a fake module, found through WORKER_CLASS_PATHS."""

    class Worker:
        def __init__(self):
            self.loaded = 0
            self.rank = 3

        def load_model(self):
            self.loaded += 1
            return "model"

        def execute_model(self, step):
            return f"step {step}"

    module = types.ModuleType("fake_vllm_worker")
    module.Worker = Worker
    monkeypatch.setitem(sys.modules, "fake_vllm_worker", module)
    monkeypatch.setattr(worker, "WORKER_CLASS_PATHS", ("fake_vllm_worker_moved:Worker", "fake_vllm_worker:Worker"))
    return Worker


def test_model_loaded_hook_runs_after_load_and_is_idempotent(fake_worker_class):
    seen = []
    native_load = fake_worker_class.load_model

    def callback(w):
        seen.append(w.loaded)

    worker.on_model_loaded(callback)
    assert worker.hook_state() == {"hooked": "fake_vllm_worker:Worker", "model_loaded": False}
    first_wrapper = fake_worker_class.load_model
    worker.on_model_loaded(callback)  # the plugin's register() runs once per process, but twice must not double
    assert fake_worker_class.load_model is first_wrapper and first_wrapper is not native_load
    w = fake_worker_class()
    assert w.load_model() == "model"
    assert seen == [1], "one call per load, after the model is in place"
    assert worker.hook_state()["model_loaded"]
    compat.reset_for_tests()
    assert fake_worker_class.load_model is native_load and "execute_model" in vars(fake_worker_class)
    assert fake_worker_class().execute_model(1) == "step 1" and not hasattr(fake_worker_class, "sparse_attn_stats")


def test_two_callbacks_share_one_wrapper(fake_worker_class):
    order = []
    worker.on_model_loaded(lambda w: order.append("a"))
    worker.on_model_loaded(lambda w: order.append("b"))
    fake_worker_class().load_model()
    assert order == ["a", "b"]


def test_first_forward_without_the_hook_having_run_warns_once(fake_worker_class, caplog):
    worker.on_model_loaded(lambda w: None)
    w = fake_worker_class()
    with caplog.at_level("WARNING", logger="compat"):
        assert [w.execute_model(i) for i in range(3)] == ["step 0", "step 1", "step 2"]
    warnings = [r.getMessage() for r in caplog.records if "without the model-load hook" in r.getMessage()]
    assert len(warnings) == 1 and "fake_vllm_worker:Worker.load_model" in warnings[0] and "Fix:" in warnings[0]


def test_first_forward_after_the_hook_ran_is_silent(fake_worker_class, caplog):
    worker.on_model_loaded(lambda w: None)
    w = fake_worker_class()
    w.load_model()
    with caplog.at_level("WARNING", logger="compat"):
        w.execute_model(0)
    assert not caplog.records


@pytest.fixture
def importable_worker_module(tmp_path, monkeypatch):
    """A worker module on disk that nothing has imported yet (as in vLLM's API server)."""
    name = "fake_vllm_lazy_worker"
    (tmp_path / f"{name}.py").write_text(
        "class Worker:\n    def load_model(self):\n        return 'loaded'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(worker, "WORKER_CLASS_PATHS", (f"{name}:Worker",))
    yield name
    sys.modules.pop(name, None)


def test_hooking_imports_nothing_and_patches_when_vllm_imports_the_worker(importable_worker_module):
    import importlib

    seen = []
    worker.on_model_loaded(seen.append)
    worker.add_worker_rpc("sparse_attn_stats", lambda w: "stats")
    assert importable_worker_module not in sys.modules, "register() must not import the GPU worker"
    assert worker.hook_state()["hooked"] is None
    module = importlib.import_module(importable_worker_module)  # what vLLM does in a worker process
    w = module.Worker()
    assert w.load_model() == "loaded" and seen == [w] and w.sparse_attn_stats() == "stats"
    assert worker.hook_state()["hooked"] == f"{importable_worker_module}:Worker"


def test_a_worker_module_without_the_class_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    import importlib

    (tmp_path / "fake_vllm_moved_worker.py").write_text("class GPUWorker:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(worker, "WORKER_CLASS_PATHS", ("fake_vllm_moved_worker:Worker",))
    try:
        worker.on_model_loaded(lambda w: None)  # nothing is imported yet: nothing can fail here
        with caplog.at_level("ERROR", logger="compat"):
            importlib.import_module("fake_vllm_moved_worker")  # vLLM's own import must not fail because of us
        (message,) = [r.getMessage() for r in caplog.records]
        assert "no vLLM worker class to hook" in message and "SPARSE_ATTN_DISABLE=1" in message
        assert worker.hook_state()["hooked"] is None
    finally:
        sys.modules.pop("fake_vllm_moved_worker", None)


def test_a_process_without_any_worker_module_gets_no_error(monkeypatch):
    monkeypatch.setattr(worker, "WORKER_CLASS_PATHS", ("fake_vllm_nowhere:Worker",))
    worker.on_model_loaded(lambda w: None)  # the API server: no worker module, no error, nothing imported
    assert "fake_vllm_nowhere" not in sys.modules and worker.hook_state()["hooked"] is None


def test_worker_rpc_is_added_by_name(fake_worker_class):
    def stats(w, reset=False):
        return {"rank": w.rank, "reset": reset}

    worker.add_worker_rpc("sparse_attn_stats", stats)
    worker.add_worker_rpc("sparse_attn_stats", stats)  # the same function again: allowed
    assert fake_worker_class().sparse_attn_stats(reset=True) == {"rank": 3, "reset": True}


def test_worker_rpc_refuses_to_shadow_an_existing_attribute(fake_worker_class):
    fake_worker_class.determine_num_available_blocks = lambda self: 7
    with pytest.raises(HookError) as info:
        worker.add_worker_rpc("determine_num_available_blocks", lambda w: 0)
    assert "already has an attribute" in info.value.observed
    assert fake_worker_class().determine_num_available_blocks() == 7, "the worker's own method is untouched"
    worker.add_worker_rpc("mine", lambda w: 1)
    with pytest.raises(HookError):
        worker.add_worker_rpc("mine", lambda w: 2)  # another function under a taken name


def test_worker_accessors():
    w = types.SimpleNamespace(rank=2, model_runner=types.SimpleNamespace(get_model=lambda: "m"),
                              vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(model="org/model")))
    assert worker.worker_model(w) == "m" and worker.worker_checkpoint(w) == "org/model" and worker.worker_rank(w) == 2
    assert worker.worker_rank(object()) == 0


# --------------------------------------------------------------------------- forward call
T = (torch.zeros(1),) * 7  # layer, query, key, value, kv_cache, attn_metadata, output
MD = object()


@pytest.mark.parametrize("args, kwargs, native_only", [
    pytest.param(("L", "q", "k", "v", "c", MD, "o"), {}, None, id="positional"),
    pytest.param(("L", "q", "k", "v", "c"), {"attn_metadata": MD, "output": "o"}, None, id="keywords"),
    pytest.param(("L", "q", "k", "v", "c", MD, "o", None, None), {}, None, id="explicit-none-scales"),
    pytest.param(("L", "q", "k", "v", "c", MD, "o", "s"), {}, "fused output quantisation", id="output-scale"),
    pytest.param(("L", "q", "k", "v", "c", MD, "o"), {"output_block_scale": "b"}, "fused output quantisation", id="block-scale"),
    pytest.param(("L", "q", "k", "v", "c", None, "o"), {}, "profiling run", id="no-metadata"),
    pytest.param(("L", "q", "k", "v", "c", MD), {}, "'output' missing", id="output-missing"),
    pytest.param(("L", "q", "k", "v", "c", MD, None), {}, "no output buffer", id="output-none"),
    pytest.param(("L", "q", "k", "v", "c", MD, "o"), {"output_zero_point": 1}, "keyword 'output_zero_point'", id="new-keyword"),
    pytest.param(("L", "q", "k", "v", "c", MD, "o", None, None, "x"), {}, "positional argument 9", id="extra-positional"),
    pytest.param(("L", "q", "k", "v", "c", MD, "o"), {"query": "q2"}, "'query' given twice", id="duplicate"),
])
def test_describe_call(args, kwargs, native_only):
    call = worker.describe_call(*args, **kwargs)
    if native_only is None:
        assert call.native_only is None
        assert (call.layer, call.query, call.key, call.value, call.kv_cache, call.attn_metadata, call.output) == \
            ("L", "q", "k", "v", "c", MD, "o")
    else:
        assert native_only in call.native_only
    assert call.args == args and call.kwargs == kwargs


class Native:
    def __init__(self):
        self.num_heads = 4
        self.buffers = [1]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None, **extra):
        return ("native", layer, output_scale, output_block_scale, extra)


class Mixin:
    def forward(self, *args, **kwargs):
        return worker.call_native(self, worker.describe_call(*args, **kwargs))


def test_replace_impl_keeps_state_class_and_forwards_exactly():
    layer = types.SimpleNamespace(impl=Native())
    native = layer.impl
    impl = worker.replace_impl(layer, Mixin, {"_sa_marker": 5})
    assert layer.impl is impl and isinstance(impl, Native) and type(impl).__name__ == "SparseNative"
    assert impl.num_heads == 4 and impl.buffers is native.buffers and impl._sa_marker == 5
    assert impl.forward("L", *T[1:], output_block_scale="b", future=1) == ("native", "L", None, "b", {"future": 1})
    other = types.SimpleNamespace(impl=Native())
    assert type(worker.replace_impl(other, Mixin, {})) is type(impl), "one subclass per native class"


class SlottedNative:
    __slots__ = ("num_heads", "scale")

    def __init__(self):
        self.num_heads = 8
        self.scale = 0.5

    def forward(self, *args, **kwargs):
        return "slotted"


def test_replace_impl_copies_slots():
    layer = types.SimpleNamespace(impl=SlottedNative())
    impl = worker.replace_impl(layer, Mixin, {"_sa_marker": 1})
    assert (impl.num_heads, impl.scale, impl._sa_marker) == (8, 0.5, 1) and isinstance(impl, SlottedNative)


class Final:
    def __init_subclass__(cls, **kwargs):
        raise TypeError("Final cannot be subclassed")


def test_replace_impl_refuses_with_a_reason_and_leaves_the_layer_alone():
    native = Final()
    layer = types.SimpleNamespace(impl=native)
    with pytest.raises(ImplReplacementError) as info:
        worker.replace_impl(layer, Mixin, {})
    assert "Final cannot be subclassed" in info.value.observed and "served natively" in info.value.fix
    assert layer.impl is native


def test_replacing_a_sparse_impl_again_rebuilds_from_the_native_class():
    layer = types.SimpleNamespace(impl=Native())
    first = worker.replace_impl(layer, Mixin, {"_sa_marker": 1, "_sa_old": "x"})
    second = worker.replace_impl(layer, Mixin, {"_sa_marker": 2})  # no MRO TypeError from (Mixin, SparseNative)
    assert type(second) is type(first) and type(second).__mro__[1:3] == (Mixin, Native)
    assert second._sa_marker == 2 and not hasattr(second, "_sa_old"), "only the new install's state"
    assert worker.native_class(second) is Native and second.buffers is first.buffers


def test_restore_impl_gives_back_the_native_class_and_state():
    layer = types.SimpleNamespace(impl=Native())
    native = layer.impl
    worker.replace_impl(layer, Mixin, {"_sa_marker": 1})
    assert worker.restore_impl(layer) is True
    assert type(layer.impl) is Native and layer.impl.__dict__ == native.__dict__
    assert worker.restore_impl(layer) is False, "a native impl is left as it is"
