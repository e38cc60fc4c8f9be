"""What the simulated model "generates": output lengths and token text.

Lengths come from a seeded geometric distribution (a memoryless end-of-sequence), capped by
max_tokens; with ignore_eos the output is always max_tokens long. Each generated token is one of
the tokenizer's single-token words (`Tokenizer.output_vocab`, e.g. " w1282" for the captures'
tiny model, a frequent word for the BPE), so generated text re-tokenizes to the number of tokens
generated, and a request's output is a pure function of its salt: the HTTP pod's response, a
stream's pieces and the next chat turn's history all agree.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Sequence

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


def _picks(salt: int, start: int, stop: int, n: int) -> list[int]:
    """Indexes into an n-word vocabulary of output tokens [start, stop)."""
    base = salt % n
    mult = 1 + 2 * ((salt >> 16) % 37)  # odd stride, so consecutive tokens vary
    return [(base + i * mult) % n for i in range(start, stop)]


def token_text(salt: int, start: int, stop: int, vocab: Sequence[str]) -> str:
    """Text of output tokens [start, stop) of the request with this salt."""
    return "".join([vocab[k] for k in _picks(salt, start, stop, len(vocab))])


def token_ids(salt: int, start: int, stop: int, ids: array) -> array:
    """The token ids of the same tokens (`ids` parallel to the vocab given to `token_text`)."""
    return array("i", [ids[k] for k in _picks(salt, start, stop, len(ids))])


def token_piece(salt: int, i: int, vocab: Sequence[str]) -> str:
    """Text of output token i alone (for streaming one token per event)."""
    return vocab[_picks(salt, i, i + 1, len(vocab))[0]]
