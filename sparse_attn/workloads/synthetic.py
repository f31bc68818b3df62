"""RULER-style synthetic long-context calibration prompts, generated locally.

Nothing is downloaded: text comes from built-in word lists and a seeded RNG,
then a caller-supplied tokenizer (anything with ``encode(text) -> list[int]``,
e.g. a Hugging Face tokenizer) measures it and the haystack is sized so the
prompt fits its length bin.

Tasks (modelled on the RULER benchmark categories; our own templates):

``niah_multikey``
    Several "special magic number" needles keyed by distinct names hidden in a
    filler essay; the question asks for one key's number.
``variable_tracking``
    A chain of assignments ``VAR X = 12345``, ``VAR Y = VAR X`` ... scattered
    through repetitive noise; the question asks which variables hold the value.
``frequent_words``
    A long list of coded words with Zipf-like frequencies; the question asks
    for the three most frequent ones.
``qa``
    Many short synthetic documents about invented organisations; the question
    asks a fact stated in one of them.

Length bins
-----------
``length_bins(max_seqlen, min_seqlen)`` (:mod:`.lengths`) gives ``max_seqlen, max_seqlen/2, ...``
down to (and including) the first value ``>= min_seqlen``, optionally capped to
``num_length_bins`` bins. ``num_samples`` samples are spread round-robin: sample
``i`` goes to bin ``i % n_bins`` and task ``(i // n_bins) % n_tasks``, so every
(bin, task) pair is covered once ``num_samples >= n_bins * n_tasks``.

Within a bin the prompts are *staggered*: the ``r``-th sample of a bin
(``r = i // n_bins``) is sized to at most
``(bin - num_decode_tokens) * (1 - length_spread * u_r)`` tokens, where ``u_r``
is the van der Corput sequence ``0, 1/2, 1/4, 3/4, 1/8, ...``; so the first
sample of each bin fills it, and any number of samples cover the band
``[1 - length_spread, 1]`` of the budget evenly. Why: decode sparsity at one
scale depends on the KV length of each step, not only on the content (on the
demo's tiny model a launch skips 6 % of its tiles at kv_len 2030-2049 and 96 %
at 2010-2019, the same for every prompt), so prompts all packed against the bin
top measure decode in one narrow band of KV lengths, and another prompt set,
whose lengths land a few dozen tokens away (haystack granularity, another
decode budget), sees another sparsity. ``length_spread=0`` packs every prompt
against the top. The output is a pure function of (seed, tokenizer, parameters),
and sample ``i`` does not depend on ``num_samples``.

Errors are :class:`~sparse_attn.errors.CalibrationDataError`;
their fixes name ``sparse-attn calibrate`` flags (``--calib_max_seqlen``,
``--calib_min_seqlen``, ``--decode_tokens``). The prompt-file format is in
:mod:`sparse_attn.workloads.prompts`; the primitives (essays, needles, noise) in
:mod:`sparse_attn.workloads.text`.
"""

from __future__ import annotations

import random
from typing import Callable, Iterable

from sparse_attn.errors import CalibrationDataError

from . import text
from .lengths import largest_fitting, length_bins
from .prompts import CalibrationSample, Tokenizer

__all__ = ["DEFAULT_LENGTH_SPREAD", "TASKS", "generate_calibration_samples", "qa_task"]

TASKS = ("niah_multikey", "variable_tracking", "frequent_words", "qa")


# --------------------------------------------------------------------------- #
# tasks: each returns build(n) -> (prompt, answers); n = haystack size
# --------------------------------------------------------------------------- #
def _task_niah_multikey(rng: random.Random, hay_seed: str) -> Callable[[int], tuple[str, tuple[str, ...]]]:
    num_needles = 4
    keys, values = text.needles(rng, num_needles)
    depths = [rng.random() for _ in keys]
    asked = rng.randrange(num_needles)

    def build(n: int) -> tuple[str, tuple[str, ...]]:
        hay = text.essay(random.Random(hay_seed), n)
        body = " ".join(text.insert(hay, text.needle_sentences(keys, values), depths))
        prompt = (
            "Some special magic numbers are hidden in the text below. Memorize them; "
            "you will be asked about one of them afterwards.\n\n"
            f"{body}\n\n"
            f"What is the special magic number for {keys[asked]} mentioned in the text above? "
            f"The special magic number for {keys[asked]} is"
        )
        return prompt, (values[asked],)

    return build


def _task_variable_tracking(rng: random.Random, hay_seed: str) -> Callable[[int], tuple[str, tuple[str, ...]]]:
    hops = 4
    names, value, statements = text.variable_chain(rng, hops)
    depths = sorted(rng.random() for _ in statements)  # keep the chain in order

    def build(n: int) -> tuple[str, tuple[str, ...]]:
        body = " ".join(text.insert([text.NOISE] * n, statements, depths))
        prompt = (
            "Memorize and track the chain(s) of variable assignments hidden in the following text.\n\n"
            f"{body}\n\n"
            f"Question: Find all variables that are assigned the value {value} in the text above. "
            f"Answer: According to the chain(s) of variable assignment in the text above, "
            f"{hops + 1} variables are assigned the value {value}, they are:"
        )
        return prompt, tuple(names)

    return build


def _task_frequent_words(rng: random.Random, hay_seed: str) -> Callable[[int], tuple[str, tuple[str, ...]]]:
    vocab_size = 200
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        w = text.code_word(rng)
        if w not in vocab:
            vocab.append(w)
    # Zipf-like weights with a clear gap between rank 3 and rank 4
    weights = [1.0 / (rank + 1) ** 1.2 for rank in range(vocab_size)]
    weights[3:] = [w * 0.7 for w in weights[3:]]

    def build(n: int) -> tuple[str, tuple[str, ...]]:
        hrng = random.Random(hay_seed)
        words = hrng.choices(vocab, weights=weights, k=n * 10)
        counts: dict[str, int] = {}
        for w in words:
            counts[w] = counts.get(w, 0) + 1
        top = sorted(counts, key=lambda w: (-counts[w], vocab.index(w)))[:3]
        prompt = (
            "Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words.\n\n"
            f"{' '.join(words)}\n\n"
            "Question: What are the three most frequently appeared words in the above coded text? "
            "Answer: According to the coded text above, the three most frequently appeared words are:"
        )
        return prompt, tuple(top)

    return build


def qa_task(rng: random.Random, hay_seed: str) -> Callable[[int], tuple[str, tuple[str, ...]]]:
    gold_depth = rng.random()
    question_kind = rng.randrange(3)

    def build(n: int) -> tuple[str, tuple[str, ...]]:
        drng = random.Random(hay_seed)
        docs = []
        facts = []
        used: set[str] = set()
        for i in range(max(n, 1)):
            while True:
                org = f"{drng.choice(text.PLACES)} {drng.choice(text.INDUSTRIES).title()} {drng.choice(['Company', 'Guild', 'Works', 'Society'])}"
                if org not in used:
                    used.add(org)
                    break
                org = f"{org} {len(used)}"
                if org not in used:
                    used.add(org)
                    break
            year = str(drng.randrange(1700, 1990))
            founder = f"{drng.choice(text.FIRST_NAMES)} {drng.choice(text.LAST_NAMES)}"
            city = drng.choice(text.PLACES)
            filler = " ".join(text.essay(drng, 3))
            docs.append(
                f"Document {i + 1}:\n{org}\n{org} was founded in {year} by {founder}. "
                f"Its main office is in {city}. {filler}"
            )
            facts.append((org, year, founder, city))
        gold = min(int(gold_depth * len(docs)), len(docs) - 1)
        org, year, founder, city = facts[gold]
        question, answer = (
            (f"In which year was {org} founded?", year),
            (f"Who founded {org}?", founder),
            (f"In which city is the main office of {org}?", city),
        )[question_kind]
        prompt = (
            "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\n"
            "The following are given documents.\n\n" + "\n\n".join(docs) + "\n\n"
            f"Answer the question based on the given documents.\n\nQuestion: {question} Answer:"
        )
        return prompt, (answer,)

    return build


_TASK_BUILDERS = {
    "niah_multikey": _task_niah_multikey,
    "variable_tracking": _task_variable_tracking,
    "frequent_words": _task_frequent_words,
    "qa": qa_task,
}


# --------------------------------------------------------------------------- #
# generation
# --------------------------------------------------------------------------- #
def _count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text))


def _fit_to_budget(build: Callable[[int], tuple[str, tuple[str, ...]]], tokenizer: Tokenizer, budget: int, what: str):
    """Largest haystack size n whose prompt has ``<= budget`` tokens (by search over n)."""
    cache: dict[int, tuple[int, str, tuple[str, ...]]] = {}

    def measure(n: int) -> int:
        if n not in cache:
            prompt, answers = build(n)
            cache[n] = (_count(tokenizer, prompt), prompt, answers)
        return cache[n][0]

    if measure(1) > budget:
        raise CalibrationDataError(
            f"{what}: even the smallest prompt has {measure(1)} tokens, over the budget of {budget} tokens; "
            f"raise the length floor (--calib_min_seqlen) or lower --decode_tokens"
        )
    per_unit = max((measure(9) - measure(1)) / 8.0, 1e-3)
    guess = max(1, int(1 + (budget - measure(1)) / per_unit))
    if measure(guess) <= budget:
        lo, hi = guess, guess + max(2, guess // 10)
        while measure(hi) <= budget:
            lo, hi = hi, hi * 2
    else:
        hi, lo = guess, max(1, int(guess * 0.9))
        while measure(lo) > budget:
            hi, lo = lo, max(1, lo // 2)
    return cache[largest_fitting(lo, hi, lambda n: measure(n) <= budget)]


#: Default fraction of each bin's prompt budget that the staggered prompt lengths cover (see the module docstring).
DEFAULT_LENGTH_SPREAD = 0.25


def _van_der_corput(r: int) -> float:
    """``r``-th point of the base-2 van der Corput sequence: 0, 1/2, 1/4, 3/4, 1/8, 5/8, ... (in [0, 1))."""
    u, denom = 0.0, 1.0
    while r:
        denom *= 2.0
        r, bit = divmod(r, 2)
        u += bit / denom
    return u


def generate_calibration_samples(
    tokenizer: Tokenizer,
    *,
    num_samples: int = 24,
    max_seqlen: int = 32768,
    min_seqlen: int = 1024,
    num_length_bins: int | None = None,
    num_decode_tokens: int = 10,
    tasks: Iterable[str] = TASKS,
    seed: int = 0,
    length_spread: float = DEFAULT_LENGTH_SPREAD,
) -> list[CalibrationSample]:
    """Generate exactly ``num_samples`` prompts spread over length bins and tasks.

    Sample ``r`` of a bin has at most ``(bin - num_decode_tokens) * (1 - length_spread * u_r)``
    tokens (as counted by ``tokenizer.encode``; ``u_r`` as in the module docstring) and is as
    long as the haystack granularity allows. ``length_spread`` is in ``[0, 1)``.
    """
    if isinstance(length_spread, bool) or not isinstance(length_spread, (int, float)) or not 0.0 <= length_spread < 1.0:
        raise CalibrationDataError(f"length_spread must be a number in [0, 1), got {length_spread!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise CalibrationDataError(f"num_samples must be a positive integer, got {num_samples!r}")
    if isinstance(num_decode_tokens, bool) or not isinstance(num_decode_tokens, int) or num_decode_tokens < 0:
        raise CalibrationDataError(f"num_decode_tokens must be a non-negative integer, got {num_decode_tokens!r}")
    tasks = tuple(tasks)
    unknown = [t for t in tasks if t not in _TASK_BUILDERS]
    if not tasks or unknown:
        raise CalibrationDataError(f"unknown calibration task(s) {unknown or tasks!r}; choose from {list(_TASK_BUILDERS)}")
    if not callable(getattr(tokenizer, "encode", None)):
        raise CalibrationDataError(f"tokenizer {type(tokenizer).__name__} has no encode(text) -> list[int] method")
    bins = length_bins(max_seqlen, min_seqlen, num_length_bins)
    samples = []
    for i in range(num_samples):
        target = bins[i % len(bins)]
        task = tasks[(i // len(bins)) % len(tasks)]
        full = target - num_decode_tokens
        if full < 1:
            raise CalibrationDataError(f"length bin {target} leaves no room for prompts after {num_decode_tokens} decode tokens")
        budget = max(1, int(full * (1.0 - length_spread * _van_der_corput(i // len(bins)))))
        key = f"sparse-attn-calib:{seed}:{i}:{task}"
        build = _TASK_BUILDERS[task](random.Random(key), key + ":haystack")
        what = f"sample {i} ({task}, bin {target})"
        try:
            n_tokens, prompt, answers = _fit_to_budget(build, tokenizer, budget, what)
        except CalibrationDataError:
            if budget == full:
                raise
            # a bin too small for the staggered size still gets a prompt: the unstaggered one
            n_tokens, prompt, answers = _fit_to_budget(build, tokenizer, full, what)
        samples.append(
            CalibrationSample(prompt=prompt, task=task, target_len=target, num_tokens=n_tokens, answers=answers)
        )
    return samples
