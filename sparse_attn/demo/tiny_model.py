"""A tiny, random, *structured* Llama checkpoint for real-engine tests on CPU.

``build_tiny_llama(out_dir)`` writes a Hugging Face checkpoint directory
(``config.json``, ``model.safetensors`` in fp32, ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``) that vLLM loads as a
``LlamaForCausalLM``. Nothing is downloaded: the byte-level BPE tokenizer is
trained here, with the HF ``tokenizers`` library, on an English-like corpus
generated from a seed.

Only ``torch``, ``tokenizers`` and ``safetensors`` are needed (all of them come
with vLLM). ``transformers`` is not imported.

Attention structure
-------------------
Plain random weights give near-uniform attention, which makes sparse
attention look either trivially good or trivially bad. The q/k projections are
therefore built so that each layer has the three patterns real LLMs show:

* **sink**: every query attends strongly to the first token (BOS).
* **local window**: even-numbered KV heads (and their query heads) attend to the last few dozen tokens.
* **retrieval**: odd-numbered KV heads attend to earlier occurrences of the
  current token, wherever they are.

How this is done (HF/vLLM Llama RoPE is "neox" style: dim ``d`` and
``d + head_dim/2`` form a rotation pair with frequency ``theta ** (-2d/head_dim)``):

* Two residual-stream channels are reserved: ``BIAS_DIM`` (0) is a constant
  +``bias_amp`` in every token embedding, and ``SINK_DIM`` (1) is +``sink_amp``
  only in the BOS embedding. ``o_proj`` and ``down_proj`` never write to
  these two channels, so they reach every layer unchanged.
* *Sink*: every query head reads ``BIAS_DIM`` into the lowest-frequency RoPE
  pair, and every KV head reads ``SINK_DIM`` into the same pair. Rotation there
  is under 1 rad for 4096 positions, so q.k(BOS) stays large and positive.
* *Local window*: each even-numbered KV head reads ``BIAS_DIM`` into several middle-frequency
  pairs, and so do its query heads. Then q_i.k_j = sum_d a^2 cos(f_d (i - j)),
  which peaks at i = j and decays over roughly 1/min(f_d) tokens: a soft
  window, whatever the tokens are.
* *Retrieval*: each odd-numbered KV head and its query heads read the same random projection
  of the *content* channels into low-frequency pairs. q_i.k_j is then large
  when tokens i and j are the same and about zero otherwise.
* Everything else (v, o, MLP, lm_head, the remaining q/k dims) is small
  Gaussian noise from ``torch.Generator().manual_seed(seed)``.

The result is deterministic per seed: the same arguments give byte-identical
``model.safetensors`` and ``tokenizer.json``.

CLI: ``python -m sparse_attn.demo.tiny_model OUT_DIR [--seed N] ...``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from pathlib import Path
from typing import Iterator

__all__ = ["build_tiny_llama", "make_corpus", "train_tokenizer", "BIAS_DIM", "SINK_DIM"]

BIAS_DIM = 0
SINK_DIM = 1
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

_WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this be "
    "has had or not but first one their its new after who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "team season film under some where three through number country since also system house "
    "river water light stone small large early long short high low old young great good little "
    "north south east west road bridge tower garden forest market harbor village island valley "
    "king queen council army ship train station letter book song music story word name day night "
    "morning evening winter summer spring autumn red green blue black white gold silver iron "
    "walks runs reads writes builds opens closes finds keeps takes gives holds sees hears makes "
    "quickly slowly often never always again together alone almost nearly perhaps because while"
).split()
_ONSETS = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "rk"]


def _pseudo_word(rng: random.Random) -> str:
    n = rng.choice((1, 2, 2, 3, 3, 4))
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n))


def make_corpus(seed: int = 0, num_sentences: int = 6000) -> Iterator[str]:
    """English-like sentences: real function words mixed with seeded pseudo-words,
    numbers and punctuation. Deterministic per seed."""
    rng = random.Random(seed)
    lexicon = list(_WORDS) + sorted({_pseudo_word(rng) for _ in range(2500)})
    for _ in range(num_sentences):
        n = rng.randint(5, 18)
        words = []
        for _ in range(n):
            r = rng.random()
            if r < 0.55:
                words.append(rng.choice(_WORDS))
            elif r < 0.95:
                words.append(rng.choice(lexicon))
            else:
                words.append(str(rng.randint(0, 2100)))
        words[0] = words[0].capitalize()
        sep = rng.choice([", ", " "]) if n > 8 else " "
        mid = n // 2
        text = " ".join(words[:mid]) + sep + " ".join(words[mid:]) + rng.choice([".", ".", ".", "?", "!"])
        yield text


def train_tokenizer(vocab_size: int = 2048, seed: int = 0):
    """Byte-level BPE trained on :func:`make_corpus`. Adds BOS (``<s>``) in front
    of every encoded sequence (like Llama). Returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_corpus(seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def _build_weights(*, seed, num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab,
                   bias_amp, sink_amp, sink_gain, local_gain, retrieval_gain,
                   local_pairs, retrieval_pairs):
    import torch

    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=0.02):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    half = head_dim // 2
    group = heads // kv_heads
    content = torch.arange(2, hidden)  # residual channels that carry token identity

    w = {}
    emb = torch.zeros(vocab, hidden)
    emb[:, content] = torch.randn(vocab, hidden - 2, generator=g)  # RMS ~1
    emb[:, BIAS_DIM] = bias_amp
    emb[BOS_ID, SINK_DIM] = sink_amp
    w["model.embed_tokens.weight"] = emb

    # Per unit of normalised input: after RMSNorm the BIAS channel is about
    # bias_amp / rms(x). Work in those units and let the gains set the logits.
    rms = math.sqrt((hidden - 2 + bias_amp**2) / hidden)
    b = bias_amp / rms
    scale = head_dim**-0.5

    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        q = randn(heads * head_dim, hidden)
        k = randn(kv_heads * head_dim, hidden)
        q[:, :2] = 0.0
        k[:, :2] = 0.0
        sink_d = half - 1  # lowest-frequency pair
        # sink: every query head carries b * a_q on sink_d, every KV head reads SINK_DIM.
        s_norm = sink_amp / math.sqrt((hidden - 2 + bias_amp**2 + sink_amp**2) / hidden)
        a = math.sqrt(sink_gain / scale)
        for h in range(heads):
            q[h * head_dim + sink_d, BIAS_DIM] = a / b
        for kh in range(kv_heads):
            k[kh * head_dim + sink_d, SINK_DIM] = a / s_norm
        # A KV head's non-sink keys must not look like a sink for the bias
        # direction either: nothing reads BIAS_DIM into sink_d on k.
        for kh in range(kv_heads):
            qs = range(kh * group, (kh + 1) * group)
            if kh % 2 == 0:  # local window
                a_loc = math.sqrt(local_gain / (scale * len(local_pairs))) / b
                for d in local_pairs:
                    k[kh * head_dim + d, BIAS_DIM] = a_loc
                    for i, h in enumerate(qs):
                        # later heads in the group get a softer window
                        q[h * head_dim + d, BIAS_DIM] = a_loc / (1 + i)
            else:  # retrieval by content
                dims = [d for pr in retrieval_pairs for d in (pr, pr + half)]
                r = torch.randn(len(dims), hidden - 2, generator=g)
                r = r / math.sqrt(hidden - 2)  # r @ x_content has norm ~ sqrt(len(dims))
                c = math.sqrt(retrieval_gain / (scale * len(dims)))
                for j, d in enumerate(dims):
                    k[kh * head_dim + d, content] = c * r[j]
                    for i, h in enumerate(qs):
                        q[h * head_dim + d, content] = c * r[j] / (1 + i)
        w[p + "self_attn.q_proj.weight"] = q
        w[p + "self_attn.k_proj.weight"] = k
        w[p + "self_attn.v_proj.weight"] = randn(kv_heads * head_dim, hidden, std=0.1)
        o = randn(hidden, heads * head_dim)
        o[:2] = 0.0
        w[p + "self_attn.o_proj.weight"] = o
        w[p + "mlp.gate_proj.weight"] = randn(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = randn(intermediate, hidden)
        dn = randn(hidden, intermediate)
        dn[:2] = 0.0
        w[p + "mlp.down_proj.weight"] = dn
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    w["model.norm.weight"] = torch.ones(hidden)
    # lm_head: Gaussian noise over the content channels only (the two reserved
    # channels and the PAD/BOS rows are zero, so greedy decoding never emits them).
    lm = randn(vocab, hidden, std=0.5)
    lm[:, :2] = 0.0
    lm[PAD_ID] = 0.0
    lm[BOS_ID] = 0.0
    w["lm_head.weight"] = lm
    return {name: t.contiguous() for name, t in w.items()}


def build_tiny_llama(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 2048,
    max_position: int = 8192,
    intermediate: int | None = None,
    rope_theta: float = 10000.0,
    sink_gain: float = 5.0,
    local_gain: float = 7.0,
    retrieval_gain: float = 9.0,
) -> Path:
    """Write a random structured Llama checkpoint + tokenizer to ``out_dir``.

    ``head_dim`` must be one the vLLM CPU attention backend accepts
    (32, 64, 80, 96, 112, 128, ...). ``vocab`` is the BPE target size; the model's
    ``vocab_size`` equals the trained tokenizer's size (which can be smaller if
    the corpus runs out of merges). The ``*_gain`` values are the approximate
    pre-softmax logit (after the 1/sqrt(head_dim) scale) of the sink, the
    local-window peak, and a same-token retrieval match; unrelated pairs sit
    near 0. Returns the directory as a ``Path``.
    """
    if hidden % 2 or head_dim % 2 or heads % kv_heads:
        raise ValueError("hidden and head_dim must be even, heads a multiple of kv_heads")
    half = head_dim // 2
    if half < 8:
        raise ValueError("head_dim must be >= 16")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    intermediate = intermediate or 2 * hidden

    tok = train_tokenizer(vocab, seed=seed)
    vocab_size = tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))

    # RoPE frequency of pair d is theta**(-2d/head_dim). Local: pairs whose
    # period is ~25..300 tokens; retrieval: slow pairs (period >> 1000 tokens)
    # except the last one, which is the sink's.
    freqs = [rope_theta ** (-2 * d / head_dim) for d in range(half)]
    local_pairs = [d for d in range(half) if 0.02 <= freqs[d] <= 0.25][:5] or [half // 4]
    retrieval_pairs = [d for d in range(half - 1) if freqs[d] < 0.005][-4:] or [half - 2]

    from safetensors.torch import save_file

    weights = _build_weights(
        seed=seed, num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, intermediate=intermediate, vocab=vocab_size,
        bias_amp=4.0, sink_amp=8.0, sink_gain=sink_gain, local_gain=local_gain,
        retrieval_gain=retrieval_gain, local_pairs=local_pairs, retrieval_pairs=retrieval_pairs,
    )
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
        "sparse_attn_demo": {
            "seed": seed,
            "sink_gain": sink_gain,
            "local_gain": local_gain,
            "retrieval_gain": retrieval_gain,
            "local_rope_pairs": local_pairs,
            "retrieval_rope_pairs": retrieval_pairs,
            "sink_rope_pair": half - 1,
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
         "do_sample": False}, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": max_position, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"},
        indent=2) + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sparse_attn.demo.tiny_model",
        description="Write a tiny random Llama checkpoint (fp32 safetensors + locally trained "
                    "BPE tokenizer) with sink / local-window / retrieval attention heads, "
                    "loadable by vLLM. No network access.",
    )
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32, help="32/64/... (vLLM CPU backend sizes)")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE target vocabulary size")
    ap.add_argument("--max-position", type=int, default=8192)
    args = ap.parse_args(argv)
    out = build_tiny_llama(
        args.out_dir, seed=args.seed, num_layers=args.num_layers, hidden=args.hidden,
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, vocab=args.vocab,
        max_position=args.max_position,
    )
    from sparse_attn.config import read_config_json

    cfg = read_config_json(out)  # the one reader of config.json
    print(f"wrote {out} (vocab_size={cfg['vocab_size']}, layers={cfg['num_hidden_layers']}, "
          f"head_dim={cfg['head_dim']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
