"""Worker extension of tests/engine/test_serving_features.py: tests/engine/native_switch.py's
switch back to vLLM's impl, plus serving another ``sparse_attention_config`` in the same engine.

``features_serve_section(section)`` puts ``section`` where the plugin reads it (the HF config vLLM
loaded, this worker's copy) and runs the plugin's own worker install, as vLLM's ``load_model`` hook
does at start-up (a second install starts from the native impls). So one engine start serves a tiny
lambda, then natively, then at a scale that skips tiles.
"""

from __future__ import annotations

from tests.engine.native_switch import NativeSwitch


class FeaturesExt(NativeSwitch):
    def features_serve_section(self, section: dict) -> dict:
        """Serve ``section`` from the next step on; the plugin's install summary."""
        from sparse_attn.config import SECTION_KEY
        from sparse_attn.plugin import install_in_worker

        setattr(self.vllm_config.model_config.hf_config, SECTION_KEY, section)
        return install_in_worker(self)
