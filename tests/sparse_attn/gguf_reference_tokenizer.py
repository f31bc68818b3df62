"""An independent reference tokenizer built from a GGUF file's own vocabulary, as llama.cpp
tokenises (``src/llama-vocab.cpp``): no ``tokenizers`` or ``transformers`` code is involved, so
a converted checkpoint's tokenizer can be compared against it token id for token id.

* ``gpt2`` models (SmolLM2): special tokens (types CONTROL / USER_DEFINED) are matched first;
  the rest is split by the pre-type's regexes (``smollm``: every ``\\p{N}`` alone, then the GPT-2
  regex, each applied to the pieces the previous one left, unmatched gaps kept), each piece is
  mapped to GPT-2's byte-to-unicode alphabet and merged by BPE rank.
* ``llama`` models (SentencePiece, Gemma 3): spaces become ``▁`` (plus one in front when
  ``add_space_prefix``), symbols are UTF-8 characters, the adjacent pair whose concatenation is
  in the vocabulary with the highest score merges first (leftmost on ties), and a symbol not in
  the vocabulary falls back to its ``<0xXX>`` byte tokens.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

import regex

CONTROL, USER_DEFINED = 3, 4
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
#: llama.cpp's regex lists per pre-tokenizer type (the ones the models here use).
PRE_REGEXES = {"smollm": [r"\p{N}", GPT2_REGEX], "gpt2": [GPT2_REGEX], "default": [GPT2_REGEX]}


def _split(pieces: list[str], pattern: str) -> list[str]:
    out = []
    for piece in pieces:
        pos = 0
        for m in regex.finditer(pattern, piece):
            if m.start() > pos:
                out.append(piece[pos:m.start()])
            if m.end() > m.start():
                out.append(m.group())
            pos = m.end()
        if pos < len(piece):
            out.append(piece[pos:])
    return out


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class GGUFReferenceTokenizer:
    def __init__(self, fields: dict):
        self.model = fields["model"]
        self.tokens = list(fields["tokens"])
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        types = list(fields.get("token_type") or [1] * len(self.tokens))
        self.special = sorted((t for t, k in zip(self.tokens, types) if k in (CONTROL, USER_DEFINED) and t),
                              key=len, reverse=True)
        self.scores = list(fields.get("scores") or [])
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(fields.get("merges") or [])}
        self.pre = fields.get("pre", "default")
        self.add_space_prefix = bool(fields.get("add_space_prefix", self.model == "llama"))

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for part, is_special in self._special_split(text):
            if is_special:
                out.append(self.ids[part])
            elif part:
                out += self._bpe_gpt2(part) if self.model == "gpt2" else self._spm(part)
        return out

    def _special_split(self, text: str):
        if not self.special:
            yield text, False
            return
        pattern = regex.compile("|".join(regex.escape(s) for s in self.special))
        pos = 0
        for m in pattern.finditer(text):
            yield text[pos:m.start()], False
            yield m.group(), True
            pos = m.end()
        yield text[pos:], False

    # ---- byte-level BPE (gpt2)
    def _bpe_gpt2(self, text: str) -> list[int]:
        pieces = [text]
        for pattern in PRE_REGEXES.get(self.pre, PRE_REGEXES["default"]):
            pieces = _split(pieces, pattern)
        alphabet = _byte_alphabet()
        ids = []
        for piece in pieces:
            symbols = [alphabet[b] for b in piece.encode("utf-8")]
            while len(symbols) > 1:
                pairs = [(self.ranks.get((a, b), None), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
                pairs = [(r, i) for r, i in pairs if r is not None]
                if not pairs:
                    break
                _, i = min(pairs)
                symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
            ids += [self.ids[s] for s in symbols]
        return ids

    # ---- SentencePiece BPE by score (llama)
    def _spm(self, text: str) -> list[int]:
        text = text.replace(" ", "\u2581")
        if self.add_space_prefix:
            text = "\u2581" + text
        symbols = list(text)
        while len(symbols) > 1:
            best = None
            for i in range(len(symbols) - 1):
                joined = symbols[i] + symbols[i + 1]
                idx = self.ids.get(joined)
                if idx is not None and (best is None or self.scores[idx] > best[0]):
                    best = (self.scores[idx], i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        ids = []
        for s in symbols:
            if s in self.ids:
                ids.append(self.ids[s])
            else:
                ids += [self.ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
        return ids
