"""The CUDA-graph contract: which graph level vLLM may capture for layers made sparse.

How vLLM decides (read in the released sources 0.15.1 - 0.33.0; tests/matrix/FINDINGS.md, "CUDA graphs"):
every attention backend's metadata builder declares its support with the classmethod
``get_cudagraph_support(vllm_config, kv_cache_spec) -> AttentionCGSupport`` (``NEVER=0``,
``UNIFORM_SINGLE_TOKEN_DECODE=1``, ``UNIFORM_BATCH=2``, ``ALWAYS=3``). The base class returns the class
attribute ``_cudagraph_support`` (FlashAttention sets it at import: ALWAYS with FA3/FA4, else UNIFORM_BATCH, and
its builder re-defines the same one-line classmethod in every release);
FlashInfer overrides the classmethod and answers per config (GPU arch, DCP, head counts, non-causal).
Both model runners take the minimum over the backends of all KV-cache groups and hand it to
``CompilationConfig.resolve_cudagraph_mode_and_sizes`` (from 0.20.2; 0.15.1 - 0.19.1 resolve the same way inline in
the v1 runner's ``_check_and_update_cudagraph_mode``): the v1 runner in
``GPUModelRunner._check_and_update_cudagraph_mode`` (``initialize_attn_backend``), the v2 runner
(``vllm/v1/worker/gpu/``; the default for dense models from 0.25, for all models from 0.29) in
``attn_utils.get_attn_cg_support`` (``init_attn_backend``). Both run inside the runner's
``initialize_kv_cache``.

The sparse forward is capture-safe only for uniform single-token decode batches (issue 12, item 2), so
for a backend made sparse compat makes the builder declare ``min(native, UNIFORM_SINGLE_TOKEN_DECODE)``:
with vLLM's default ``FULL_AND_PIECEWISE`` decode batches stay in full graphs, and mixed/prefill batches
(and spec-decode ones, query length > 1) run piecewise, where the attention op is a splitting op that
runs eagerly. ``SPARSE_ATTN_CUDAGRAPH=never`` declares NEVER: vLLM then drops full graphs (PIECEWISE).

WHY installing after ``load_model`` works: the plugin installs from its hook on ``Worker.load_model``
(``compat.worker.on_model_loaded``); the engine calls ``determine_available_memory`` (whose
``profile_cudagraph_memory`` builds a minimal KV cache and so resolves the mode once) and then
``initialize_from_config`` -> ``initialize_kv_cache`` only after every worker loaded its model, and both
runners call ``get_cudagraph_support`` there (v1 on the class, v2 on a builder instance), each time, and
neither ``load_model`` reads it. Verified in the sources of 0.18.1, 0.22.1, 0.25.1, 0.28.0, 0.29.0, 0.30.0,
0.31.0 and 0.33.0. One exception: 0.18.1's opt-in v2 runner (``VLLM_USE_V2_MODEL_RUNNER=1``) never asks the
builders, so there only the default v1 runner or ``--enforce-eager`` keeps sparse attention out of graphs.

``decide`` is the probe (no side effects: it reads class attributes and a function's code object, calls
nothing of vLLM's); ``restrict_cudagraph_support`` is the one install, registered in ``compat.patches``
(undone by ``compat.reset_for_tests()`` or ``patches.undo_all("layers")``).
"""

from __future__ import annotations

import enum
import functools
import logging
import types
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from compat import envs, patches
from compat.errors import CompatError

logger = logging.getLogger("compat")

METHOD = "get_cudagraph_support"
ATTRIBUTE = "_cudagraph_support"


class GraphLevel(enum.IntEnum):
    """vLLM's ``AttentionCGSupport``, by member name (same names and values in 0.15.1 - 0.33.0)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


#: What the sparse forward can be captured in: uniform decode batches, every query length 1.
SPARSE_LEVEL = GraphLevel.UNIFORM_SINGLE_TOKEN_DECODE
#: ``SPARSE_ATTN_CUDAGRAPH`` value -> the cap applied to the native level.
ENV_CAPS: Mapping[str, GraphLevel] = types.MappingProxyType(
    {"auto": SPARSE_LEVEL, "decode": GraphLevel.UNIFORM_SINGLE_TOKEN_DECODE, "never": GraphLevel.NEVER}
)


@dataclass(frozen=True)
class GraphDecision:
    """What a backend's builder declares to vLLM for sparse layers.

    ``declared_by``: ``"class-attribute"`` (the classmethod returns ``_cudagraph_support``: static),
    ``"classmethod"`` (computed per config when vLLM calls it) or ``"absent"`` (nothing to restrict).
    ``native`` / ``sparse``: level names when static, ``None`` when only known at vLLM's call time.
    ``sparse = min(native, cap)``. ``source``: ``"env"`` (``SPARSE_ATTN_CUDAGRAPH``) or ``"probe"``
    (every release read has the classmethod, so no version table is needed). ``installed``: the
    builder's declaration is wrapped in this process.
    """

    backend: str
    builder: str | None
    declared_by: str
    native: str | None
    sparse: str | None
    cap: str
    source: str
    detail: str
    installed: bool = False

    def describe(self) -> str:
        """One line for ``python -m compat`` and the plugin's install summary."""
        if self.declared_by == "absent":
            return f"cannot declare ({self.detail})"
        if self.sparse is not None:
            what = f"sparse layers declare {self.sparse} (native {self.native})"
        else:
            what = f"sparse layers declare min(native, {self.cap}), native computed by vLLM per config"
        return f"{what}{', installed' if self.installed else ''} [{self.source}] {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _backend_name(backend_cls: type) -> str:
    try:
        return str(backend_cls.get_name())
    except Exception:  # noqa: BLE001 - a name is only for display
        return backend_cls.__name__


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _resolve(builder: type) -> tuple[type | None, Any]:
    """The class in ``builder``'s MRO that defines the declaration, and the raw attribute there."""
    for klass in builder.__mro__:
        if METHOD in vars(klass):
            return klass, vars(klass)[METHOD]
    return None, None


def _original(raw: Any) -> Any:
    """The release's own function behind ``raw`` (looking through a wrapper of ours)."""
    func = raw.__func__ if isinstance(raw, classmethod) else raw
    return getattr(func, "_sparse_attn_original", func)


def _reads_only_attribute(func: Any) -> bool:
    # ``return cls._cudagraph_support`` (the base class, FlashAttention) names nothing else: no call,
    # no config field, no platform query. Any other name means the answer can depend on the config.
    code = getattr(func, "__code__", None)
    return code is not None and set(code.co_names) == {ATTRIBUTE}


def _cap() -> tuple[GraphLevel, str, str]:
    choice = envs.get("SPARSE_ATTN_CUDAGRAPH")
    if choice == "auto":
        return ENV_CAPS[choice], "probe", ""
    return ENV_CAPS[choice], "env", f"SPARSE_ATTN_CUDAGRAPH={choice}; "


def _level(member: Any, where: str) -> GraphLevel:
    try:
        return GraphLevel[member.name]
    except (AttributeError, KeyError):
        raise CompatError(
            f"{where} returned {member!r}; expected an AttentionCGSupport member named one of "
            f"{', '.join(GraphLevel.__members__)}. Fix: set SPARSE_ATTN_CUDAGRAPH=never (vLLM then keeps only "
            f"piecewise graphs), or serve with --enforce-eager."
        ) from None


def decide(backend_cls: type) -> GraphDecision:
    """Probe how ``backend_cls``'s builder declares CUDA-graph support and what sparse layers declare.

    Side-effect free: reads class attributes and a code object; calls nothing of vLLM's but
    ``get_builder_cls`` (a constant in every release).
    """
    name = _backend_name(backend_cls)
    cap, source, env_note = _cap()
    fix = "serve with --enforce-eager to keep sparse attention out of CUDA graphs"
    try:
        builder = backend_cls.get_builder_cls()
    except Exception as exc:  # noqa: BLE001 - reported: a backend without a builder declares nothing
        return GraphDecision(name, None, "absent", None, None, cap.name, source,
                             f"{env_note}{backend_cls.__name__}.get_builder_cls() failed ({type(exc).__name__}: {exc}); {fix}")
    owner, raw = _resolve(builder)
    if raw is None or not isinstance(raw, classmethod):
        found = "nothing" if raw is None else f"a {type(raw).__name__}"
        return GraphDecision(
            name, _path(builder), "absent", None, None, cap.name, source,
            f"{env_note}{builder.__name__} defines {found} as {METHOD}, so vLLM's minimum cannot be lowered; {fix}",
        )
    func = _original(raw)
    where = f"{owner.__name__}.{METHOD}"
    static = getattr(getattr(builder, ATTRIBUTE, None), "name", None) in GraphLevel.__members__
    if static and _reads_only_attribute(func):
        native = GraphLevel[getattr(builder, ATTRIBUTE).name]
        sparse = min(native, cap)
        return GraphDecision(
            name, _path(builder), "class-attribute", native.name, sparse.name, cap.name, source,
            f"{env_note}{where} returns {builder.__name__}.{ATTRIBUTE} = {native.name}; min with {cap.name}",
        )
    return GraphDecision(
        name, _path(builder), "classmethod", None, None, cap.name, source,
        f"{env_note}{where} answers per (vllm_config, kv_cache_spec); min with {cap.name} when vLLM calls it",
    )


#: builder class -> the decision installed on it (its patch is in ``compat.patches``, scope "layers").
_INSTALLED: dict[type, GraphDecision] = {}
#: (builder path, native, declared) already logged once.
_SEEN: set[tuple[str, str, str]] = set()
#: backends whose builder declares nothing, already warned about once.
_ABSENT_WARNED: set[str] = set()


def restrict_cudagraph_support(backend_cls: type) -> GraphDecision:
    """Make ``backend_cls``'s metadata builder declare ``min(native, cap)`` to vLLM; returns the decision.

    Call once per backend class made sparse, after ``load_model`` (see the module docstring for why that
    is early enough). Idempotent: a repeated call returns the recorded decision. Only this exact builder
    class is restricted: a subclass inheriting the wrapper (another backend we did not install) gets its
    own native answer.
    """
    try:
        builder = backend_cls.get_builder_cls()
    except Exception:  # noqa: BLE001 - decide() below reports it as "absent"
        builder = None
    if builder in _INSTALLED:
        return _INSTALLED[builder]
    decision = decide(backend_cls)
    if decision.declared_by == "absent":
        # Nothing vLLM asks can be lowered (every release 0.15-0.33 has the base
        # classmethod, so this is a backend outside them): say so once, not per layer.
        if decision.backend not in _ABSENT_WARNED:
            _ABSENT_WARNED.add(decision.backend)
            logger.warning("sparse-attn: %s: %s", decision.backend, decision.describe())
        return decision
    cap = GraphLevel[decision.cap]
    inherited = _resolve(builder)[1].__func__  # the function vLLM calls today, perhaps a parent's wrapper

    @functools.wraps(_original(inherited))
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        native = inherited(cls, vllm_config, kv_cache_spec)
        if cls is not builder:
            return native
        level = _level(native, f"{builder.__name__}.{METHOD}")
        declared = min(level, cap)
        key = (decision.builder or "", level.name, declared.name)
        if key not in _SEEN:
            _SEEN.add(key)
            logger.info("sparse-attn: %s CUDA-graph support %s -> %s for sparse layers", decision.backend, level.name, declared.name)
        return type(native)[declared.name]

    get_cudagraph_support._sparse_attn_original = _original(inherited)  # type: ignore[attr-defined]
    if not _INSTALLED:
        patches.on_undo(_forget, scope="layers")
    patches.set_class_attr(builder, METHOD, classmethod(get_cudagraph_support), scope="layers")
    decision = GraphDecision(**{**decision.as_dict(), "installed": True})
    _INSTALLED[builder] = decision
    return decision


def installed() -> Mapping[str, GraphDecision]:
    """The decisions installed in this process, by backend name (for the plugin's summary)."""
    return types.MappingProxyType({d.backend: d for d in _INSTALLED.values()})


def _forget() -> None:
    # The patches themselves are restored by compat.patches.undo_all (newest first, so a parent's
    # wrapper is restored after its subclass'); this forgets what they decided.
    _INSTALLED.clear()
    _ABSENT_WARNED.clear()
    _SEEN.clear()
