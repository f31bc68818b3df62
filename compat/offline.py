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


def eval_engine_kwargs(*, model: str, dtype: str, max_model_len: int, seed: int, backend: str | None = None,
                       hf_overrides: Mapping[str, Any] | None = None, kv_cache_bytes: int | None = None,
                       extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments for an eval engine: the calibration engine's (eager, no prefix cache,
    whole prompts per step: so a prefill is measured as calibration measured it) plus
    ``hf_overrides`` (how eval serves another target: a replaced ``sparse_attention_config``)."""
    extra = dict(extra or {})
    if kv_cache_bytes is not None:
        extra.setdefault("kv_cache_memory_bytes", int(kv_cache_bytes))
    kwargs = calibration_engine_kwargs(model=model, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=1,
                                       seed=seed, backend=backend, extra=extra)
    if hf_overrides:
        kwargs["hf_overrides"] = dict(hf_overrides)
    return kwargs


def sampling_params(*, max_tokens: int, prompt_logprobs: int | None = None, logprobs: int | None = None,
                    ignore_eos: bool = True) -> Any:
    """Greedy sampling of ``max_tokens`` tokens; ``prompt_logprobs=0`` returns each prompt token's own logprob and
    rank; ``logprobs=k`` the top-k of every generated step."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, prompt_logprobs=prompt_logprobs,
                          logprobs=logprobs)


def _logprob(entry: Any, token: int) -> tuple[float, int] | None:
    if entry is None:
        return None
    item = entry.get(token) if hasattr(entry, "get") else None
    if item is None:
        raise CompatError("a prompt_logprobs entry lacks the prompt token's own logprob",
                          observed=f"keys {list(entry)[:5]}", expected=f"token {token} among them",
                          fix="request prompt_logprobs=0 or more (vLLM always includes the prompt token)")
    return float(item.logprob), int(item.rank) if item.rank is not None else 0


def generate(llm: Any, prompts: Sequence[Sequence[int]], params: Any) -> list[Generation]:
    """Run token-id ``prompts`` through ``llm`` (one batch, vLLM schedules it) and read the results."""
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    results = []
    for out in outputs:
        ids = tuple(int(t) for t in out.prompt_token_ids)
        plp = out.prompt_logprobs
        logprobs = None if plp is None else tuple(_logprob(plp[i], ids[i]) for i in range(len(ids)))
        first = out.outputs[0]
        steps = None
        if first.logprobs is not None:
            steps = tuple({int(t): float(lp.logprob) for t, lp in step.items()} for step in first.logprobs)
        results.append(Generation(prompt_token_ids=ids, token_ids=tuple(int(t) for t in first.token_ids),
                                  text=first.text, prompt_logprobs=logprobs, step_logprobs=steps))
    return results
