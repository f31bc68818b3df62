"""Text primitives every built-in prompt is made of: word lists, filler sentences and essays,
keyed needles, variable-assignment chains and their insertion at fractional depths.

Each function draws from the ``random.Random`` it is given, in a fixed order, so a prompt is a
pure function of its stream's seed: calibration and eval key their streams differently
(:mod:`.synthetic`, :mod:`.tasks`), and the same primitive in both never repeats a prompt.
"""

from __future__ import annotations

import random
import string
from typing import Sequence

__all__ = ["ADJECTIVES", "FIRST_NAMES", "INDUSTRIES", "LAST_NAMES", "NOISE", "NOUNS", "PLACES", "code_word", "essay",
           "insert", "needle_sentences", "needles", "sentence", "variable_chain"]

NOUNS = (
    "river mountain garden window city harbor library market bridge forest engine island village "
    "lantern orchard canal meadow tower valley school museum theater station kitchen workshop field "
    "castle desert ocean harvest journey letter story painting song machine signal compass ledger "
    "archive season morning evening winter summer autumn spring storm harbor coastline plateau "
    "factory railway printer notebook teacher farmer sailor merchant doctor painter builder writer"
).split()
VERBS = (
    "builds carries finds keeps opens remembers describes follows changes measures gathers reveals "
    "shapes crosses watches answers teaches explores repairs records collects discovers imagines "
    "questions protects delivers organizes studies considers"
).split()
ADJECTIVES = (
    "quiet bright ancient narrow careful distant gentle heavy hidden modern patient rapid silent "
    "simple steady strange sudden warm wide curious golden humble early late open"
).split()
ADVERBS = "slowly often rarely quickly carefully always gradually patiently suddenly quietly".split()
CONNECTORS = (
    "Meanwhile, However, In practice, Over time, For example, As a result, Later, In the end, "
    "At first, Still, Even so, Because of this,"
).split(", ")
PLACES = (
    "Northbridge Alderport Casterfield Dunmore Elmstead Fairhaven Glenrock Hollowmere Ironvale "
    "Juniper Bay Kestrel Point Larkspur Millbrook Norwick Oakhurst Pinecrest Queensford Ravenhill "
    "Stonegate Thornbury"
).split()
FIRST_NAMES = "Ada Boris Clara Dmitri Elena Felix Greta Hugo Irene Jonas Kira Leon Mira Nils Olga Pavel Rosa Sven Tara Viktor".split()
LAST_NAMES = "Abbott Brandt Castell Dorn Ellery Falk Grimm Hale Ivers Jansen Keller Lund Moreau Novak Ortega Price Quist Rowe Sato Varga".split()
INDUSTRIES = "shipping textiles glassworks printing clockmaking brewing ceramics bookbinding shipbuilding tea trading".split()
#: The repeated filler of the variable-tracking haystacks (RULER's noise).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def sentence(rng: random.Random) -> str:
    """One filler sentence of one of four grammatical forms."""
    n1, n2 = rng.choice(NOUNS), rng.choice(NOUNS)
    form = rng.randrange(4)
    if form == 0:
        s = f"The {rng.choice(ADJECTIVES)} {n1} {rng.choice(VERBS)} the {n2}."
    elif form == 1:
        s = f"{rng.choice(CONNECTORS)} every {n1} {rng.choice(ADVERBS)} {rng.choice(VERBS)} a {rng.choice(ADJECTIVES)} {n2}."
    elif form == 2:
        s = f"A {n1} near the {rng.choice(ADJECTIVES)} {n2} {rng.choice(VERBS)} what the {rng.choice(NOUNS)} {rng.choice(VERBS)}."
    else:
        s = f"No one {rng.choice(VERBS).rstrip('s')}s the {n1} as {rng.choice(ADVERBS)} as the {rng.choice(ADJECTIVES)} {n2}."
    return s


def essay(rng: random.Random, n: int) -> list[str]:
    """``n`` filler sentences (the haystack of the needle and QA tasks)."""
    return [sentence(rng) for _ in range(n)]


def insert(units: list[str], items: Sequence[str], depths: Sequence[float]) -> list[str]:
    """Insert ``items`` at fractional depths of ``units`` (stable, deterministic)."""
    out = list(units)
    for item, depth in sorted(zip(items, depths), key=lambda t: t[1], reverse=True):
        out.insert(int(round(depth * len(units))), item)
    return out


def code_word(rng: random.Random, length: int = 6) -> str:
    """A random lowercase word of ``length`` letters."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(length))


def needles(rng: random.Random, count: int) -> tuple[list[str], list[str]]:
    """``count`` distinct keys (``adjective-noun``) and a 7-digit number for each."""
    keys: list[str] = []
    while len(keys) < count:
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if k not in keys:
            keys.append(k)
    return keys, [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]


def needle_sentences(keys: Sequence[str], values: Sequence[str]) -> list[str]:
    """The sentence that hides each key's number in a haystack."""
    return [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]


def variable_chain(rng: random.Random, hops: int) -> tuple[list[str], str, list[str]]:
    """``hops + 1`` distinct 5-letter names, a 5-digit value and the chain ``VAR A = value. VAR B = VAR A. ...``:
    ``(names, value, statements)``; every name holds the value."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    return names, value, statements
