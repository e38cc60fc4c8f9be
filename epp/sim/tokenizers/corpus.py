"""A deterministic English-like language: the text the shipped BPE tokenizer is trained on and
the text simulated workloads send.

Real prompts are mostly prose with some numbers, punctuation and code. What matters to a
tokenizer is the *statistics*: word frequencies follow Zipf's law, frequent words are short and
rare ones long, sentences carry commas and end in a full stop or a question mark, numbers and
identifiers split into several tokens. The language here has those statistics, made from a
seeded lexicon of pronounceable pseudo-words, so a BPE tokenizer trained on it gives the spread
of characters per token natural text gives (common words one token, rare words two to four),
and workload text drawn from it tokenizes the same way.

Everything is a pure function of a `random.Random`, so a seed fixes the text on every platform.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
from dataclasses import dataclass

LEXICON_SIZE = 40_000
ZIPF_S = 1.0
_LEXICON_SEED = "epp-corpus-lexicon-v1"

# Syllable parts with rough English letter-sequence frequencies (weights).
_ONSETS = (("", 6), ("t", 6), ("s", 5), ("r", 4), ("l", 4), ("n", 4), ("m", 4), ("d", 4), ("c", 3),
           ("p", 3), ("b", 3), ("h", 3), ("f", 2), ("g", 2), ("w", 2), ("v", 1), ("k", 1), ("th", 3),
           ("st", 2), ("ch", 1), ("sh", 1), ("pr", 1), ("tr", 1), ("gr", 1), ("br", 1), ("cl", 1),
           ("pl", 1), ("fr", 1), ("wh", 1), ("sp", 1), ("j", 1), ("y", 1), ("qu", 0.5), ("z", 0.3))
_VOWELS = (("e", 8), ("a", 7), ("o", 6), ("i", 6), ("u", 3), ("ea", 1), ("ou", 1), ("ai", 0.7),
           ("ee", 0.6), ("io", 0.6), ("oo", 0.5), ("y", 0.5), ("ie", 0.4), ("au", 0.3))
_CODAS = (("", 10), ("n", 4), ("r", 4), ("s", 3), ("t", 3), ("l", 3), ("d", 2), ("m", 1.5),
          ("nd", 1), ("st", 1), ("ng", 1), ("nt", 1), ("rt", 0.6), ("ck", 0.5), ("x", 0.2),
          ("ll", 0.6), ("ss", 0.5), ("rs", 0.4), ("ts", 0.4), ("th", 0.4), ("ch", 0.3))
_SUFFIXES = ("", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ment", "ness", "able", "al")


def _table(pairs: tuple[tuple[str, float], ...]) -> tuple[tuple[str, ...], list[float]]:
    return tuple(p for p, _ in pairs), list(itertools.accumulate(w for _, w in pairs))


_ON, _ON_W = _table(_ONSETS)
_VO, _VO_W = _table(_VOWELS)
_CO, _CO_W = _table(_CODAS)


def _pick(rng: random.Random, items: tuple[str, ...], cum: list[float]) -> str:
    return items[bisect.bisect(cum, rng.random() * cum[-1])]


def _pseudo_word(rng: random.Random, letters: int) -> str:
    """A pronounceable word of `letters` letters (give or take one when that length is rare)."""
    word = ""
    for attempt in range(60):
        parts: list[str] = []
        n = 0
        while n < letters:
            s = _pick(rng, _ON, _ON_W) + _pick(rng, _VO, _VO_W)
            if rng.random() < 0.45:
                s += _pick(rng, _CO, _CO_W)
            parts.append(s)
            n += len(s)
        word = "".join(parts)
        if letters >= 7 and rng.random() < 0.3:
            suffix = rng.choice(_SUFFIXES)
            word = word[: max(2, letters - len(suffix))] + suffix
        if abs(len(word) - letters) <= attempt // 20:
            break
    return word


@dataclass(slots=True, frozen=True)
class Lexicon:
    """Words by frequency rank with their Zipf cumulative weights, plus proper names."""

    words: tuple[str, ...]
    cum_weights: tuple[float, ...]
    names: tuple[str, ...]

    def sample(self, rng: random.Random, k: int) -> list[str]:
        return rng.choices(self.words, cum_weights=self.cum_weights, k=k)


@functools.cache
def lexicon() -> Lexicon:
    """The language's words (built once per process; the same on every machine)."""
    rng = random.Random(_LEXICON_SEED)
    seen: set[str] = set()
    words: list[str] = []
    # Frequent words are short: mean length grows with log(rank), as in English.
    for rank in itertools.count():
        if len(words) == LEXICON_SIZE:
            break
        mean = 2.2 + 1.3 * math.log10(rank + 1)
        letters = max(1, int(round(rng.gauss(mean, 0.8 + 0.15 * mean))))
        w = _pseudo_word(rng, letters)
        if w not in seen:
            seen.add(w)
            words.append(w)
    names = []
    while len(names) < 2000:
        w = _pseudo_word(rng, rng.randint(4, 8))
        if w not in seen:
            seen.add(w)
            names.append(w.capitalize())
    cum = tuple(itertools.accumulate(1.0 / (r + 1) ** ZIPF_S for r in range(LEXICON_SIZE)))
    return Lexicon(tuple(words), cum, tuple(names))


def number(rng: random.Random) -> str:
    u = rng.random()
    if u < 0.35:
        return str(rng.randint(0, 99))
    if u < 0.55:
        return str(rng.randint(100, 9999))
    if u < 0.7:
        return str(rng.randint(1900, 2030))
    if u < 0.8:
        return f"{rng.randint(0, 999)}.{rng.randint(0, 99):02d}"
    if u < 0.9:
        return f"{rng.randint(1, 100)}%"
    return f"${rng.randint(1, 5000)}"


def sentence(rng: random.Random, lex: Lexicon | None = None) -> str:
    """One sentence: 3-40 words, commas, a number or a name now and then, final punctuation."""
    lex = lex or lexicon()
    n = min(40, max(3, int(rng.lognormvariate(2.55, 0.5))))
    words = lex.sample(rng, n)
    out: list[str] = []
    for i, w in enumerate(words):
        u = rng.random()
        if u < 0.025:
            w = number(rng)
        elif u < 0.045:
            w = rng.choice(lex.names)
        elif u < 0.05 and i:
            w = f'"{w}"'
        elif u < 0.054 and i:
            w = f"({w})"
        if i == 0:
            w = w[:1].upper() + w[1:]
        if i < n - 1 and rng.random() < 0.07:
            w += rng.choice((",", ",", ",", ";", ":", " -"))
        out.append(w)
    u = rng.random()
    end = "." if u < 0.86 else "?" if u < 0.95 else "!" if u < 0.98 else "..."
    return " ".join(out) + end


def _identifier(rng: random.Random, lex: Lexicon) -> str:
    parts = lex.sample(rng, rng.randint(1, 3))
    if rng.random() < 0.7:
        return "_".join(parts)
    return parts[0] + "".join(p.capitalize() for p in parts[1:])


def code(rng: random.Random, lex: Lexicon | None = None) -> str:
    """A short Python-like function: identifiers, operators, numbers, strings, indentation."""
    lex = lex or lexicon()
    name = _identifier(rng, lex)
    args = [_identifier(rng, lex) for _ in range(rng.randint(0, 3))]
    lines = [f"def {name}({', '.join(args)}):"]
    if rng.random() < 0.5:
        lines.append(f'    """{sentence(rng, lex)}"""')
    vars_ = args or [_identifier(rng, lex)]
    for _ in range(rng.randint(1, 6)):
        target = _identifier(rng, lex)
        a, b = rng.choice(vars_), rng.choice(vars_)
        u = rng.random()
        if u < 0.3:
            lines.append(f"    {target} = {a} + {rng.randint(0, 512)}")
        elif u < 0.5:
            lines.append(f"    {target} = {a}.{_identifier(rng, lex)}({b})")
        elif u < 0.65:
            lines.append(f'    {target} = "{" ".join(lex.sample(rng, rng.randint(1, 4)))}"')
        elif u < 0.8:
            lines.append(f"    if {a} > {rng.randint(0, 99)}:\n        {target} = [{a}, {b}]")
        elif u < 0.9:
            lines.append(f"    for {target} in range(len({a})):\n        {b} += {target} * 2")
        else:
            lines.append(f"    # {sentence(rng, lex)}")
        vars_.append(target)
    lines.append(f"    return {rng.choice(vars_)}")
    return "\n".join(lines)


def paragraph(rng: random.Random, lex: Lexicon | None = None) -> str:
    lex = lex or lexicon()
    return " ".join(sentence(rng, lex) for _ in range(rng.randint(2, 7)))


def document(rng: random.Random, paragraphs: int, code_share: float = 0.1) -> str:
    """Paragraphs of prose, some of them code, separated by blank lines."""
    lex = lexicon()
    parts = []
    for _ in range(paragraphs):
        parts.append(code(rng, lex) if rng.random() < code_share else paragraph(rng, lex))
    return "\n\n".join(parts)
