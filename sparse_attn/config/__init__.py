"""The ``sparse_attention_config`` section of a checkpoint's ``config.json``.

This is the calibration hand-off format written by NVIDIA ModelOpt and read by
TensorRT-LLM (and by this project): one or more ``config_groups``, at most one
of which uses the skip-softmax (BLASST) algorithm, carrying an exponential
calibration curve per phase::

    {
      "sparse_attention_config": {
        "config_groups": {
          "group_0": {
            "algorithm": "skip_softmax",
            "targets": ["LlamaAttention"],
            "ignore": ["model.layers.0.self_attn"],
            "threshold_scale_factor": {
              "formula": "a * exp(b * target_sparsity)",
              "prefill": {"a": 7.93, "b": 8.61},
              "decode": {"a": 0.12, "b": 9.85}
            },
            "target_sparsity": {"prefill": 0.5, "decode": 0.5}
          }
        },
        "producer": {"name": "sparse-attn", "version": "0.1.0"}
      }
    }

At run time the skip threshold of a phase is::

    scale  = a * exp(b * target_sparsity)      # "threshold_scale_factor"
    lambda = scale / kv_len                     # what the kernel compares against

Sliding-window layers may have their own curve, written by ``sparse-attn calibrate``
for models that mix windowed and global layers (Gemma 2/3, gpt-oss), in the group key
``sliding_window_threshold_scale_factor`` (same shape, same ``target_sparsity``)::

    lambda = scale_w / min(kv_len, window)      # on a layer with a window of `window` tokens

ModelOpt and TensorRT-LLM read the group keys they know and do not read this one, so for
them the checkpoint holds one curve (``threshold_scale_factor``, fitted on the global
layers) applied to every layer as ``scale / kv_len``. Without the key, sparse-attn does
the same.

Accepted input variants (all normalised to the layout above by ``to_dict``):

* **Per-group layout** (current ModelOpt / TensorRT-LLM): ``algorithm``,
  ``threshold_scale_factor``, ``target_sparsity`` inside the group.
* **Legacy ModelOpt layout**: the group says ``"sparse_algo": "softmax_skip"``
  and ``threshold_scale_factor`` / ``target_sparse_ratio`` sit at the top of
  the section. They are hoisted into the skip-softmax group.
* **Phase-agnostic coefficients** (TensorRT-LLM VisualGen):
  ``"threshold_scale_factor": {"formula": ..., "coefficients": {"a":..,"b":..}}``
  applies the same curve to both phases.
* ``target_sparsity`` as a scalar (both phases) or ``{"prefill":.., "decode":..}``.
* Formulas: ``a * exp(b * target_sparsity)`` (coefficients ``a``, ``b``) and
  ``exp(log_a + b * target_sparsity)`` (coefficients ``log_a``, ``b``); the
  comparison ignores whitespace. TensorRT-LLM evaluates arbitrary numexpr
  formulas; we deliberately do not evaluate arbitrary expressions, so any other
  formula is rejected with the list of supported ones.

Whose section is it?
--------------------
The key ``sparse_attention_config`` is shared: vLLM's MiniMax-M3 config uses
it for its own sparse attention (``use_sparse_attention``,
``sparse_topk_blocks``, ...; no ``config_groups``). A section is ModelOpt /
TensorRT-LLM metadata only by its *shape*: ``config_groups`` whose groups carry
``algorithm`` or ``sparse_algo``. Anything else is not ours:
:func:`read_section` says so in one line and the model keeps native
attention. (Qwen dual-chunk attention reads a separate *file*,
``sparse_attention_config.json``; nothing here reads or writes that file.)

Several groups: ModelOpt exports e.g. an N:M ``sparse_softmax`` group beside
the skip-softmax one. We serve the (single) skip-softmax group and report
every other group with its algorithm (:attr:`SparseAttentionConfig.unserved_groups`);
``to_dict`` keeps those groups verbatim, in their original order.

Bounds
------
A curve is rejected unless ``ln(scale) = ln(a) + b * t`` stays within
``[-LN_SCALE_BOUND, LN_SCALE_BOUND]`` for every target ``t`` in ``[0, 1]``, so
the scale factor (and lambda) is a finite, non-zero float at every target a
runtime override can ask for. ``re:`` patterns are checked before any match:
nested quantifiers, alternation inside a repeat and back-references (which
backtrack exponentially) are rejected, as are more than
``MAX_UNBOUNDED_REPEATS`` unbounded repeats or patterns longer than
``MAX_PATTERN_LENGTH``, because every worker matches every layer at start-up
and Python's ``re`` cannot be interrupted. An empty ``re:`` (it matches every
name) is rejected too: write ``*`` to mean every layer.

Missing calibration for a phase (no coefficients) means that phase runs dense;
it is listed in :attr:`SparseAttentionConfig.missing_phases` so the caller can
log it once. A phase with coefficients but no target falls back to
``DEFAULT_TARGET_SPARSITY`` (0.5, ModelOpt's default for old checkpoints) and
is reported in :attr:`SparseAttentionConfig.warnings`.

Module matching (``targets`` / ``ignore``)
------------------------------------------
ModelOpt writes attention *class names* into ``targets`` (e.g.
``"LlamaAttention"``; ``"Attention"`` when the class was unknown) and
fnmatch patterns of *module names* into ``ignore``. A pattern matches a layer
when it

* starts with ``re:`` and the rest ``re.match``-es the layer name or one of
  the class names (compressed-tensors convention), or
* fnmatch-es (case-sensitive) one of the given class names, or
* fnmatch-es the layer name or any contiguous dotted part of it, so
  ``blocks.0.attn1`` matches ``transformer.blocks.0.attn1`` (component
  relative, as TensorRT-LLM documents) and ``model.layers.0.self_attn``
  matches the vLLM layer ``model.layers.0.self_attn.attn`` (the HF module
  that owns it).

The literal target ``"Attention"`` additionally matches any class name that
ends with ``Attention`` (ModelOpt's "unknown class" fallback). No ``targets``
means every attention layer is targeted. ``ignore`` wins over ``targets``.
"""

from __future__ import annotations

from sparse_attn.protocol import PHASES

from .errors import SparseAttentionConfigError
from .io import config_value, load_from_checkpoint, read_config_json, text_model_config
from .parse import SectionReading, is_modelopt_section, parse_sparse_attention_config, read_section
from .policy import Startup, StartupRefused, startup_notes
from .regex_guard import MAX_PATTERN_LENGTH, MAX_UNBOUNDED_REPEATS
from .schema import (
    DEFAULT_FORMULA,
    DEFAULT_TARGET_SPARSITY,
    DISABLE_HINT,
    LN_SCALE_BOUND,
    LOG_FORMULA,
    SECTION_KEY,
    SUPPORTED_ALGORITHMS,
    SUPPORTED_FORMULAS,
    PhaseFit,
    Producer,
    SkipSoftmaxGroup,
    SparseAttentionConfig,
    UnservedGroup,
    WINDOW_CURVE_KEY,
)

__all__ = [
    "DEFAULT_FORMULA",
    "DISABLE_HINT",
    "LN_SCALE_BOUND",
    "LOG_FORMULA",
    "MAX_PATTERN_LENGTH",
    "MAX_UNBOUNDED_REPEATS",
    "DEFAULT_TARGET_SPARSITY",
    "PHASES",
    "SECTION_KEY",
    "SUPPORTED_ALGORITHMS",
    "SUPPORTED_FORMULAS",
    "PhaseFit",
    "Producer",
    "SkipSoftmaxGroup",
    "SparseAttentionConfig",
    "SectionReading",
    "Startup",
    "StartupRefused",
    "SparseAttentionConfigError",
    "UnservedGroup",
    "WINDOW_CURVE_KEY",
    "is_modelopt_section",
    "config_value",
    "load_from_checkpoint",
    "parse_sparse_attention_config",
    "read_config_json",
    "text_model_config",
    "read_section",
    "startup_notes",
]
