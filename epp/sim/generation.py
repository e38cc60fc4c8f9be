"""What the simulated model "generates": output lengths and token text.

Lengths come from a seeded geometric distribution (a memoryless end-of-sequence), capped by
max_tokens; with ignore_eos the output is always max_tokens long. Each token is a space plus a
three-letter word, i.e. exactly 4 characters, so generated text re-tokenises to the same count.
"""

from __future__ import annotations

import math
import random

_WORDS = (
    "the and for are but not you all any can her was one our out day get has him his how man new "
    "now old see two way who boy did its let put say she too use art bed big box cat cup dog ear "
    "eye fox fun hat ice jam key leg map net owl pen red sea sky sun tea top van web yes zoo arm "
    "bag bus car cow fan gas hen ink job kid lab mud oak pig rat row saw toy war wax"
).split()
VOCAB: tuple[str, ...] = tuple(" " + w for w in _WORDS)
_V = len(VOCAB)


class OutputSampler:
    """Seeded output-length draws for one pod."""

    __slots__ = ("_rng", "_log_q")

    def __init__(self, mean_tokens: float, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        p = 1.0 / max(1.0, mean_tokens)
        self._log_q = math.log(1.0 - p) if p < 1.0 else -math.inf

    def output_len(self, max_tokens: int, ignore_eos: bool) -> int:
        if ignore_eos:
            return max_tokens
        if self._log_q == -math.inf:
            return 1
        u = self._rng.random()
        n = 1 + int(math.log(1.0 - u) / self._log_q)
        return n if n < max_tokens else max_tokens

    def salt(self) -> int:
        return self._rng.getrandbits(63)


def token_text(salt: int, start: int, stop: int) -> str:
    """Text of output tokens [start, stop) of the request with this salt."""
    base = salt % _V
    mult = 1 + 2 * ((salt >> 16) % 37)  # odd stride, so consecutive tokens vary
    return "".join([VOCAB[(base + i * mult) % _V] for i in range(start, stop)])


def token_piece(salt: int, i: int) -> str:
    """Text of output token i alone (for streaming one token per event)."""
    return VOCAB[(salt % _V + i * (1 + 2 * ((salt >> 16) % 37))) % _V]
