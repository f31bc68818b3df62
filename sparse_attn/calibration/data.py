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
``length_bins(max_seqlen, min_seqlen)`` gives ``max_seqlen, max_seqlen/2, ...``
down to (and including) the first value ``>= min_seqlen``, optionally capped to
``num_length_bins`` bins. Each prompt is sized to at most
``bin - num_decode_tokens`` tokens so that prefill plus the measured decode
steps fit in the bin. ``num_samples`` samples are spread round-robin: sample
``i`` goes to bin ``i % n_bins`` and task ``(i // n_bins) % n_tasks``, so every
(bin, task) pair is covered once ``num_samples >= n_bins * n_tasks``. The
output is a pure function of (seed, tokenizer, parameters).

Prepared calibration set format (``load_calibration_dir``)
-----------------------------------------------------------
A directory containing ``samples.jsonl`` (as written by
``write_calibration_dir``), or a single file:

* ``*.jsonl`` - one JSON value per line; blank lines are ignored. Each value is
  either a string (the prompt) or an object with exactly one of
  ``"prompt": str`` or ``"prompt_token_ids": [int, ...]``, and optionally
  ``"task"``, ``"answers"`` (list of str), ``"target_len"`` (int).
* ``*.json`` - a JSON list of such values.
* anything else (e.g. ``prompts.txt``) - one prompt per non-empty line (use
  JSONL for prompts that contain newlines).

Validation raises :class:`CalibrationDataError` naming the file and line, what
is wrong, and how to fix it; with ``max_model_len`` every sample must satisfy
``prompt tokens + num_decode_tokens <= max_model_len``.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

from .fit import CalibrationError

__all__ = [
    "SAMPLES_FILE",
    "TASKS",
    "CalibrationDataError",
    "CalibrationSample",
    "Tokenizer",
    "generate_calibration_samples",
    "length_bins",
    "load_calibration_dir",
    "write_calibration_dir",
]

SAMPLES_FILE = "samples.jsonl"
MANIFEST_FILE = "manifest.json"
TASKS = ("niah_multikey", "variable_tracking", "frequent_words", "qa")


class CalibrationDataError(CalibrationError):
    """Calibration prompts are missing, malformed, empty or too long."""


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class CalibrationSample:
    """One calibration prompt (text or token ids) plus bookkeeping."""

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    task: str | None = None
    target_len: int | None = None  # length bin the sample was sized for
    num_tokens: int | None = None  # measured prompt tokens, when known
    answers: tuple[str, ...] = ()
    source: str | None = field(default=None, compare=False)  # "file:line" for loaded samples

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        for key in ("task", "target_len", "num_tokens"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.answers:
            out["answers"] = list(self.answers)
        return out


# --------------------------------------------------------------------------- #
# word lists
# --------------------------------------------------------------------------- #
_NOUNS = (
    "river mountain garden window city harbor library market bridge forest engine island village "
    "lantern orchard canal meadow tower valley school museum theater station kitchen workshop field "
    "castle desert ocean harvest journey letter story painting song machine signal compass ledger "
    "archive season morning evening winter summer autumn spring storm harbor coastline plateau "
    "factory railway printer notebook teacher farmer sailor merchant doctor painter builder writer"
).split()
_VERBS = (
    "builds carries finds keeps opens remembers describes follows changes measures gathers reveals "
    "shapes crosses watches answers teaches explores repairs records collects discovers imagines "
    "questions protects delivers organizes studies considers"
).split()
_ADJECTIVES = (
    "quiet bright ancient narrow careful distant gentle heavy hidden modern patient rapid silent "
    "simple steady strange sudden warm wide curious golden humble early late open"
).split()
_ADVERBS = "slowly often rarely quickly carefully always gradually patiently suddenly quietly".split()
_CONNECTORS = (
    "Meanwhile, However, In practice, Over time, For example, As a result, Later, In the end, "
    "At first, Still, Even so, Because of this,"
).split(", ")
_PLACES = (
    "Northbridge Alderport Casterfield Dunmore Elmstead Fairhaven Glenrock Hollowmere Ironvale "
    "Juniper Bay Kestrel Point Larkspur Millbrook Norwick Oakhurst Pinecrest Queensford Ravenhill "
    "Stonegate Thornbury"
).split()
_FIRST = "Ada Boris Clara Dmitri Elena Felix Greta Hugo Irene Jonas Kira Leon Mira Nils Olga Pavel Rosa Sven Tara Viktor".split()
_LAST = "Abbott Brandt Castell Dorn Ellery Falk Grimm Hale Ivers Jansen Keller Lund Moreau Novak Ortega Price Quist Rowe Sato Varga".split()
_INDUSTRIES = "shipping textiles glassworks printing clockmaking brewing ceramics bookbinding shipbuilding tea trading".split()
_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def _sentence(rng: random.Random) -> str:
    n1, n2 = rng.choice(_NOUNS), rng.choice(_NOUNS)
    form = rng.randrange(4)
    if form == 0:
        s = f"The {rng.choice(_ADJECTIVES)} {n1} {rng.choice(_VERBS)} the {n2}."
    elif form == 1:
        s = f"{rng.choice(_CONNECTORS)} every {n1} {rng.choice(_ADVERBS)} {rng.choice(_VERBS)} a {rng.choice(_ADJECTIVES)} {n2}."
    elif form == 2:
        s = f"A {n1} near the {rng.choice(_ADJECTIVES)} {n2} {rng.choice(_VERBS)} what the {rng.choice(_NOUNS)} {rng.choice(_VERBS)}."
    else:
        s = f"No one {rng.choice(_VERBS).rstrip('s')}s the {n1} as {rng.choice(_ADVERBS)} as the {rng.choice(_ADJECTIVES)} {n2}."
    return s


def _essay(rng: random.Random, n: int) -> list[str]:
    return [_sentence(rng) for _ in range(n)]


def _insert(units: list[str], items: Sequence[str], depths: Sequence[float]) -> list[str]:
    """Insert ``items`` at fractional depths of ``units`` (stable, deterministic)."""
    out = list(units)
    for item, depth in sorted(zip(items, depths), key=lambda t: t[1], reverse=True):
        out.insert(int(round(depth * len(units))), item)
    return out


def _code_word(rng: random.Random, length: int = 6) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(length))


# --------------------------------------------------------------------------- #
# tasks: each returns build(n) -> (prompt, answers); n = haystack size
# --------------------------------------------------------------------------- #
def _task_niah_multikey(rng: random.Random, hay_seed: str) -> Callable[[int], tuple[str, tuple[str, ...]]]:
    num_needles = 4
    keys = []
    while len(keys) < num_needles:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in keys:
            keys.append(k)
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
    depths = [rng.random() for _ in keys]
    asked = rng.randrange(num_needles)

    def build(n: int) -> tuple[str, tuple[str, ...]]:
        hay = _essay(random.Random(hay_seed), n)
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        body = " ".join(_insert(hay, needles, depths))
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
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = sorted(rng.random() for _ in statements)  # keep the chain in order

    def build(n: int) -> tuple[str, tuple[str, ...]]:
        hay = [_NOISE] * n
        body = " ".join(_insert(hay, statements, depths))
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
        w = _code_word(rng)
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


def _task_qa(rng: random.Random, hay_seed: str) -> Callable[[int], tuple[str, tuple[str, ...]]]:
    gold_depth = rng.random()
    question_kind = rng.randrange(3)

    def build(n: int) -> tuple[str, tuple[str, ...]]:
        drng = random.Random(hay_seed)
        docs = []
        facts = []
        used: set[str] = set()
        for i in range(max(n, 1)):
            while True:
                org = f"{drng.choice(_PLACES)} {drng.choice(_INDUSTRIES).title()} {drng.choice(['Company', 'Guild', 'Works', 'Society'])}"
                if org not in used:
                    used.add(org)
                    break
                org = f"{org} {len(used)}"
                if org not in used:
                    used.add(org)
                    break
            year = str(drng.randrange(1700, 1990))
            founder = f"{drng.choice(_FIRST)} {drng.choice(_LAST)}"
            city = drng.choice(_PLACES)
            filler = " ".join(_essay(drng, 3))
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
    "qa": _task_qa,
}


# --------------------------------------------------------------------------- #
# generation
# --------------------------------------------------------------------------- #
def length_bins(max_seqlen: int, min_seqlen: int = 1024, num_length_bins: int | None = None) -> list[int]:
    """``[max_seqlen, max_seqlen // 2, ...]`` while ``>= min_seqlen`` (descending), capped to ``num_length_bins``."""
    for name, value in (("max_seqlen", max_seqlen), ("min_seqlen", min_seqlen)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CalibrationDataError(f"{name} must be a positive integer number of tokens, got {value!r}")
    if max_seqlen < min_seqlen:
        raise CalibrationDataError(
            f"max_seqlen={max_seqlen} is below the length floor min_seqlen={min_seqlen}; "
            f"raise --max_seqlen or lower the floor"
        )
    if num_length_bins is not None and (isinstance(num_length_bins, bool) or not isinstance(num_length_bins, int) or num_length_bins < 1):
        raise CalibrationDataError(f"num_length_bins must be a positive integer or None, got {num_length_bins!r}")
    bins = []
    length = max_seqlen
    while length >= min_seqlen:
        bins.append(length)
        length //= 2
    return bins[:num_length_bins] if num_length_bins is not None else bins


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
            f"raise the length floor (--min_seqlen) or lower --num_decode_tokens"
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
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return cache[lo]


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
) -> list[CalibrationSample]:
    """Generate exactly ``num_samples`` prompts spread over length bins and tasks.

    Each prompt has at most ``bin - num_decode_tokens`` tokens (as counted by
    ``tokenizer.encode``) and is as long as the haystack granularity allows.
    """
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
        budget = target - num_decode_tokens
        if budget < 1:
            raise CalibrationDataError(f"length bin {target} leaves no room for prompts after {num_decode_tokens} decode tokens")
        key = f"sparse-attn-calib:{seed}:{i}:{task}"
        build = _TASK_BUILDERS[task](random.Random(key), key + ":haystack")
        n_tokens, prompt, answers = _fit_to_budget(build, tokenizer, budget, f"sample {i} ({task}, bin {target})")
        samples.append(
            CalibrationSample(prompt=prompt, task=task, target_len=target, num_tokens=n_tokens, answers=answers)
        )
    return samples


# --------------------------------------------------------------------------- #
# persistence
# --------------------------------------------------------------------------- #
def write_calibration_dir(path: str | Path, samples: Sequence[CalibrationSample], *, metadata: dict | None = None) -> Path:
    """Write ``samples.jsonl`` (and ``manifest.json`` when ``metadata`` is given) atomically; returns the jsonl path."""
    from .export import write_text_atomic

    if not samples:
        raise CalibrationDataError("refusing to write an empty calibration set")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(s.to_json(), ensure_ascii=False) + "\n" for s in samples)
    out = directory / SAMPLES_FILE
    write_text_atomic(out, text)
    if metadata is not None:
        write_text_atomic(directory / MANIFEST_FILE, json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    return out


def _err(where: str, what: str, fix: str) -> CalibrationDataError:
    return CalibrationDataError(f"{where}: {what}. Fix: {fix}")


_JSONL_FIX = 'each line must be a JSON string or an object with "prompt": "..." or "prompt_token_ids": [1, 2, ...]'


def _sample_from_value(value: Any, where: str) -> CalibrationSample:
    if isinstance(value, str):
        if not value.strip():
            raise _err(where, "empty prompt", "remove the line or give it text")
        return CalibrationSample(prompt=value, source=where)
    if not isinstance(value, dict):
        raise _err(where, f"expected a JSON object or string, got {type(value).__name__}", _JSONL_FIX)
    has_prompt, has_ids = "prompt" in value, "prompt_token_ids" in value
    if has_prompt == has_ids:
        raise _err(where, 'needs exactly one of "prompt" or "prompt_token_ids"' + (" (found both)" if has_prompt else ""), _JSONL_FIX)
    prompt = ids = None
    if has_prompt:
        prompt = value["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise _err(where, f'"prompt" must be a non-empty string, got {prompt!r:.60}', _JSONL_FIX)
    else:
        raw = value["prompt_token_ids"]
        if (
            not isinstance(raw, list)
            or not raw
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw)
        ):
            raise _err(where, '"prompt_token_ids" must be a non-empty list of non-negative integers', _JSONL_FIX)
        ids = tuple(raw)
    answers = value.get("answers", ())
    if isinstance(answers, str):
        answers = (answers,)
    if not isinstance(answers, (list, tuple)) or not all(isinstance(a, str) for a in answers):
        raise _err(where, '"answers" must be a list of strings', "fix or drop the answers field")
    target_len = value.get("target_len")
    if target_len is not None and (isinstance(target_len, bool) or not isinstance(target_len, int) or target_len <= 0):
        raise _err(where, f'"target_len" must be a positive integer, got {target_len!r}', "fix or drop the target_len field")
    task = value.get("task")
    if task is not None and not isinstance(task, str):
        raise _err(where, f'"task" must be a string, got {task!r}', "fix or drop the task field")
    return CalibrationSample(
        prompt=prompt,
        prompt_token_ids=ids,
        task=task,
        target_len=target_len,
        num_tokens=len(ids) if ids is not None else None,
        answers=tuple(answers),
        source=where,
    )


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise _err(str(file), f"not UTF-8 text ({exc.reason} at byte {exc.start})", "save the prompts as UTF-8") from None
    except OSError as exc:
        raise _err(str(file), f"cannot be read ({exc.strerror})", "check the path and permissions") from None


def _load_file(file: Path) -> list[CalibrationSample]:
    text = _read_text(file)
    samples = []
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{file}:{lineno}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _err(where, f"invalid JSON ({exc.msg} at column {exc.colno})", _JSONL_FIX) from None
            samples.append(_sample_from_value(value, where))
    elif suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _err(f"{file}:{exc.lineno}", f"invalid JSON ({exc.msg})", "write a JSON list of prompts") from None
        if not isinstance(values, list):
            raise _err(str(file), f"expected a JSON list of prompts, got {type(values).__name__}", "write a JSON list, or use JSONL")
        samples = [_sample_from_value(v, f"{file}[{i}]") for i, v in enumerate(values)]
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                samples.append(CalibrationSample(prompt=line, source=f"{file}:{lineno}"))
    return samples


def load_calibration_dir(
    path: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    max_model_len: int | None = None,
    num_decode_tokens: int = 0,
) -> list[CalibrationSample]:
    """Load and validate a prepared calibration set (directory or file, see module docstring).

    With ``max_model_len`` each sample must have ``tokens + num_decode_tokens
    <= max_model_len``; text prompts are measured with ``tokenizer`` (required
    then). Measured counts are stored in ``CalibrationSample.num_tokens``.
    """
    p = Path(path)
    if p.is_dir():
        file = p / SAMPLES_FILE
        if not file.is_file():
            found = sorted(x.name for x in p.iterdir())[:10]
            raise _err(
                str(p),
                f"no {SAMPLES_FILE} in the calibration directory (found: {found or 'nothing'})",
                f"point at a directory written by `sparse-attn calibrate --save_data DIR`, or at a .jsonl/.txt prompts file",
            )
    elif p.is_file():
        file = p
    else:
        raise _err(str(p), "no such file or directory", "check the calibration data path")
    samples = _load_file(file)
    if not samples:
        raise _err(str(file), "the calibration set is empty", "add at least one prompt (more than 8 long prompts recommended)")
    if max_model_len is None:
        return samples
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0:
        raise CalibrationDataError(f"max_model_len must be a positive integer, got {max_model_len!r}")
    limit = max_model_len - num_decode_tokens
    checked = []
    for s in samples:
        if s.prompt_token_ids is not None:
            n = len(s.prompt_token_ids)
        else:
            if tokenizer is None:
                raise CalibrationDataError(
                    f"{s.source}: a tokenizer is needed to measure text prompts against max_model_len={max_model_len}"
                )
            n = _count(tokenizer, s.prompt)
        if n > limit:
            raise _err(
                s.source or str(file),
                f"prompt has {n} tokens; with {num_decode_tokens} decode tokens it needs {n + num_decode_tokens} "
                f"> max_model_len={max_model_len}",
                "regenerate the data with a smaller --max_seqlen, drop the sample, or raise --max_model_len",
            )
        checked.append(s if s.num_tokens == n else _replace(s, num_tokens=n))
    return checked


def _replace(sample: CalibrationSample, **changes: Any) -> CalibrationSample:
    from dataclasses import replace

    return replace(sample, **changes)
