"""The built-in prompts are data: moving their code (issue 31 item 3, into ``sparse_attn.workloads``)
must not change one token of them. The digests below were computed from the tree before the move
(0e49f20: ``calibration.synthetic``, ``calibration.prompts``, ``evaluation.tasks``,
``calibration.cli.TASK_PROMPT_MARGIN``) with this file's tokenizers, in a fresh process with a random
``PYTHONHASHSEED``; a change to a generator, a word list or a random stream's key changes them.
A deliberate change to the prompts updates the digests in the same commit and says why.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib

import pytest

from sparse_attn.workloads.lengths import TASK_PROMPT_MARGIN
from sparse_attn.workloads.prompts import ChatTemplatePrompts
from sparse_attn.workloads.synthetic import generate_calibration_samples
from sparse_attn.workloads.tasks import EVAL_TASKS, build_samples


class CrcTokenizer:
    """Words (with their leading space) as tokens, id = CRC-32 of the piece: the same ids in every
    process (``hash()`` is salted per process), decoding back exactly."""

    chat_template = None

    def __init__(self):
        self.pieces: dict[int, str] = {}

    def encode(self, text, add_special_tokens=True):
        ids = []
        for piece in re.findall(r"\s*\S+|\s+", text):
            token = zlib.crc32(piece.encode("utf-8"))
            self.pieces[token] = piece
            ids.append(token)
        return ids

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


class CrcChatTokenizer(CrcTokenizer):
    chat_template = "<user>{content}</user><assistant>"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return [1] + self.encode(messages[0]["content"]) + [2]


def _digest(rows) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def _synthetic(tokenizer, **kwargs) -> str:
    samples = generate_calibration_samples(tokenizer, **kwargs)
    return _digest([(s.prompt, s.task, s.target_len, s.num_tokens, list(s.answers)) for s in samples])


def _tasks(tokenizer, stream: str) -> str:
    samples = build_samples(tokenizer, tasks=EVAL_TASKS, lengths=[512, 1024], per_cell=1, seed=0,
                            reserve=16 + TASK_PROMPT_MARGIN, stream=stream)
    return _digest([(s.task, s.length, s.index, list(s.prompt_token_ids), list(s.answers), s.answer_text,
                     list(s.answer_token_ids)) for s in samples])


CASES = {
    # --calib_set synthetic: every task in two bins, seed 0
    "synthetic": (lambda: _synthetic(CrcTokenizer(), num_samples=8, max_seqlen=2048, min_seqlen=1024,
                                     num_decode_tokens=10, seed=0),
                  "53e89c4d5d537955d4ba386299a5ed22cb36e27207ae3c84353cd6e04f776269"),
    # the same generator measured through a chat template (--chat_template on)
    "synthetic-chat": (lambda: _synthetic(ChatTemplatePrompts(CrcChatTokenizer()), num_samples=4, max_seqlen=1024,
                                          min_seqlen=1024, num_decode_tokens=16, seed=5),
                       "151141599290bc2b7f7a121c1b2832d8fecc838f9fee5e5494653c96e9ff11ea"),
    # sparse-attn eval's held-out prompts (a base model: no template)
    "tasks-eval": (lambda: _tasks(CrcTokenizer(), "eval"),
                   "1827fcffdb2837f2f1156ceabf351cd163aad79330ae02e57656596528649da5"),
    # --calib_set tasks: the same kinds from calibration's stream, chat-wrapped
    "tasks-calib": (lambda: _tasks(CrcChatTokenizer(), "calib"),
                    "7289455fbb8f1f87f45a74129394c1981a308a3e2e0b7f23ee0782376d4c1229"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_built_in_prompts_are_the_same_tokens_as_before_the_move(case):
    build, expected = CASES[case]
    assert build() == expected


def test_the_digest_sees_a_one_token_change():
    """Guards the test: the digest covers the prompt itself, not only its bookkeeping."""
    samples = generate_calibration_samples(CrcTokenizer(), num_samples=1, max_seqlen=1024, min_seqlen=1024, seed=0)
    rows = [(s.prompt, s.task, s.target_len, s.num_tokens, list(s.answers)) for s in samples]
    changed = [(rows[0][0].replace(" the ", " a ", 1), *rows[0][1:])]
    assert changed != rows and _digest(changed) != _digest(rows)
