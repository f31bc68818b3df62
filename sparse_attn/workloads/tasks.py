"""Held-out RULER-style tasks with known answers, as token ids, for ``sparse-attn eval``.

Each sample is ``context + question`` (the user turn) and an *answer lead-in* the assistant turn
starts with (``The special magic number for X is:``), so that a correct greedy continuation begins
with the answer and the same answer tokens can be teacher-forced. With a chat template the prompt
is the template's own token ids (``apply_chat_template(..., tokenize=True)``, never its text
tokenised again, which would add a second BOS) followed by the lead-in's ids; without one (a base
model) it is the tokenizer's encoding of ``user + "\\n" + lead-in``.

Tasks (our own templates, after the RULER categories):

``niah_single``   one 7-digit "special magic number" in a filler essay;
``niah_multikey`` four keyed numbers, one asked;
``variable_tracking`` a chain ``VAR A = 12345. VAR B = VAR A. ...``, asked which names hold the value;
``common_words``  a list of words in which a few are far more frequent, asked for the three most frequent;
``qa``            many short documents about invented organisations, asked one fact.

Held out: every sample's random stream is keyed ``sparse-attn-eval:SEED:TASK:LENGTH:I``; calibration's
are ``sparse-attn-calib:SEED:I:TASK`` (:mod:`sparse_attn.workloads.synthetic`) and, for
``--calib_set tasks`` (these kinds of prompt), ``sparse-attn-calib:SEED:TASK:LENGTH:I``: no seed of one
reproduces a prompt of another. Lengths count the whole prompt (template included).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sparse_attn.errors import CalibrationDataError

from . import text
from .lengths import largest_fitting
from .prompts import ChatTemplatePrompts
from .synthetic import qa_task

__all__ = ["EVAL_TASKS", "EvalSample", "build_samples", "encode_prompt"]

EVAL_TASKS = ("niah_single", "niah_multikey", "variable_tracking", "common_words", "qa")

#: build(n) -> (user text, assistant lead-in, answers); n = haystack size.
Builder = Callable[[int], tuple[str, str, tuple[str, ...]]]


@dataclass(frozen=True)
class EvalSample:
    task: str
    length: int  # the length bin (prompt tokens at most)
    index: int
    prompt_token_ids: tuple[int, ...]
    answers: tuple[str, ...]
    #: The answer as the model should write it after the lead-in (answers joined), and its token ids.
    answer_text: str
    answer_token_ids: tuple[int, ...]


def _niah(rng: random.Random, num_needles: int) -> Builder:
    keys, values = text.needles(rng, num_needles)
    depths = [rng.random() for _ in keys]
    asked = rng.randrange(num_needles)
    hay_seed = rng.random()

    def build(n: int):
        hay = text.essay(random.Random(hay_seed), n)
        body = " ".join(text.insert(hay, text.needle_sentences(keys, values), depths))
        some = "A special magic number is" if num_needles == 1 else "Some special magic numbers are"
        user = (f"{some} hidden in the following text. Make sure to memorize it. I will quiz you about "
                f"the number afterwards.\n\n{body}\n\nWhat is the special magic number for {keys[asked]} "
                f"mentioned in the provided text?")
        return user, f"The special magic number for {keys[asked]} mentioned in the provided text is:", (values[asked],)

    return build


def _variable_tracking(rng: random.Random) -> Builder:
    hops = 3
    names, value, statements = text.variable_chain(rng, hops)
    depths = sorted(rng.random() for _ in statements)

    def build(n: int):
        body = " ".join(text.insert([text.NOISE] * n, statements, depths))
        user = (f"Memorize and track the chain of variable assignments hidden in the following text.\n\n{body}\n\n"
                f"Question: Find all variables that are assigned the value {value} in the text above.")
        return user, (f"Answer: According to the chain of variable assignments in the text above, {hops + 1} "
                      f"variables are assigned the value {value}, they are:"), tuple(names)

    return build


def _common_words(rng: random.Random) -> Builder:
    common = [w for w in rng.sample(text.NOUNS, 3)]
    rare_pool = [w for w in text.NOUNS + text.ADJECTIVES if w not in common]
    hay_seed = rng.random()

    def build(n: int):
        hrng = random.Random(hay_seed)
        words = []
        for _ in range(n):  # each unit: the 3 common words once, 10 rare ones; common words stay 3x+ more frequent
            unit = common + hrng.sample(rare_pool, 10)
            hrng.shuffle(unit)
            words += unit
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        user = (f"Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                f"ones that appear most often.\n\n{listing}\n\nQuestion: What are the 3 most common words in the above list?")
        return user, "Answer: The top 3 words that appear most often in the list are:", tuple(common)

    return build


def _qa(rng: random.Random) -> Builder:
    qa = qa_task(rng, f"eval-qa:{rng.random()}")

    def build(n: int):
        prompt, answers = qa(n)
        head, question = prompt.rsplit("Question: ", 1)
        user = head.rstrip() + "\n\nQuestion: " + question.rsplit(" Answer:", 1)[0]
        return user, "Answer:", answers

    return build


_BUILDERS: dict[str, Callable[[random.Random], Builder]] = {
    "niah_single": lambda rng: _niah(rng, 1),
    "niah_multikey": lambda rng: _niah(rng, 4),
    "variable_tracking": _variable_tracking,
    "common_words": _common_words,
    "qa": _qa,
}


def encode_prompt(tokenizer: Any, user: str, lead_in: str) -> list[int]:
    """The prompt's token ids: the chat template's own ids plus the lead-in, or plain text for a base model."""
    if getattr(tokenizer, "chat_template", None):
        return ChatTemplatePrompts(tokenizer).encode(user) + tokenizer.encode(lead_in, add_special_tokens=False)
    return tokenizer.encode(user + "\n" + lead_in)


def _answer_text(task: str, answers: Sequence[str]) -> str:
    return " " + (", ".join(answers) if len(answers) > 1 else answers[0])


#: Random streams: the eval's, and calibration's ``--calib_set tasks`` (same kinds of prompt, other prompts).
STREAMS = ("eval", "calib")


def build_samples(tokenizer: Any, *, tasks: Sequence[str], lengths: Sequence[int], per_cell: int, seed: int,
                  reserve: int = 32, progress: Any = None, stream: str = "eval") -> list[EvalSample]:
    """``per_cell`` samples for each (task, length): each prompt as long as the haystack granularity
    allows within ``length - reserve`` tokens (``reserve``: room for the answer and the decode steps).
    ``stream``: ``eval`` (held out) or ``calib`` (calibration on the same kinds of prompt); no seed of
    one stream reproduces a prompt of the other."""
    if stream not in STREAMS:
        raise CalibrationDataError(f"unknown stream {stream!r}; expected one of {STREAMS}")
    unknown = [t for t in tasks if t not in _BUILDERS]
    if unknown:
        raise CalibrationDataError(f"unknown eval task(s) {unknown}; choose from {list(EVAL_TASKS)}")
    samples = []
    for task in tasks:
        for length in lengths:
            for i in range(per_cell):
                rng = random.Random(f"sparse-attn-{stream}:{seed}:{task}:{length}:{i}")
                build = _BUILDERS[task](rng)

                def prompt_of(n: int, _b=build):
                    user, lead, answers = _b(n)
                    return encode_prompt(tokenizer, user, lead), answers

                ids, answers = _largest(prompt_of, length - reserve, f"{task} at {length} tokens")
                answer_text = _answer_text(task, answers)
                answer_ids = list(tokenizer.encode(answer_text, add_special_tokens=False))
                # A tokenizer that splits digits (SmolLM2: " 4821937" -> " ", "4", "8", ...) makes the answer's
                # first token a bare space, whose probability says nothing about retrieval: it goes to the prompt,
                # as the model's own tokenisation of "is: 4821937" has it, and the first answer token is a digit.
                while len(answer_ids) > 1 and not tokenizer.decode(answer_ids[:1]).strip():
                    ids, answer_ids = [*ids, answer_ids[0]], answer_ids[1:]
                    answer_text = answer_text[1:] if answer_text[:1].isspace() else answer_text
                samples.append(EvalSample(
                    task=task, length=length, index=i, prompt_token_ids=tuple(ids), answers=tuple(answers),
                    answer_text=answer_text, answer_token_ids=tuple(answer_ids),
                ))
                if progress is not None:
                    progress.update(1)
    return samples


def _largest(prompt_of: Callable[[int], tuple[list[int], tuple[str, ...]]], budget: int, what: str):
    """The prompt of the largest haystack size whose token count is <= ``budget`` (bisection over n)."""
    cache: dict[int, tuple[list[int], tuple[str, ...]]] = {}

    def size(n: int) -> int:
        if n not in cache:
            cache[n] = prompt_of(n)
        return len(cache[n][0])

    if size(1) > budget:
        raise CalibrationDataError(f"{what}: the smallest prompt has {size(1)} tokens, over the budget of {budget}; "
                                   f"use longer --lengths")
    per_unit = max((size(9) - size(1)) / 8.0, 1e-3)
    lo = max(1, int(1 + (budget - size(1)) / per_unit * 0.9))
    while size(lo) > budget:
        lo = max(1, lo // 2)
    hi = lo + 1
    while size(hi) <= budget:
        lo, hi = hi, hi * 2
    return cache[largest_fitting(lo, hi, lambda n: size(n) <= budget)]
