"""Workload text of a requested number of tokens, with its token ids, without tokenizing it.

A virtual-time run sends millions of prompt tokens; tokenizing every prompt would cost more than
simulating it. But byte-level BPE (and whitespace pre-tokenizers) never merge across a boundary
where a non-space character is followed by a space: the space starts a new pre-token. So text is
assembled from *units* that each start with one space and end with a non-space character (a word
with its punctuation, a number, a line of code), each tokenized once per process: the ids of a
concatenation are the concatenation of the ids. Sentences, paragraphs and code from `corpus.py`
are cut into such units; a text is a few single words (so every text differs from its first
block on), then whole sentences, then a cut sentence and single-token words to reach the count
exactly. A shared prefix (a system prompt, a document, the chat so far) is a text too, so the
EPP's character blocks and the engine's token blocks see the same sharing they would in
production, not aligned.

For tokenizers where the rule does not hold (checked on a sample when the source is built) the
text is tokenized after all; `chars4` keeps its old random hex (4 characters, one token).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from epp.sim.tokenizers import corpus
from epp.sim.tokens import Chars4Tokenizer, HfTokenizer, Tokenizer

_CHUNKS = 2000
_WORDS = 5000
_HEAD_WORDS = 6
_CHECK = 200
# Units begin at a space that follows a non-space character.
_UNIT_START = re.compile(r"(?<=\S)(?= )")


@dataclass(slots=True, frozen=True)
class Text:
    """A piece of prompt text and its token ids (no special tokens)."""

    text: str
    ids: array

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(slots=True, frozen=True)
class _Chunk:
    """Units of text (a word, or sentences): where each unit ends, in characters and in tokens."""

    text: str
    ids: bytes  # int32 token ids, as bytes so that texts are joined with one C call
    tokens: int
    char_ends: tuple[int, ...]
    token_ends: tuple[int, ...]


class TextSource:
    """Random text for one tokenizer: `unique(rng, n)`, the chat role markers and `join`."""

    user: Text  # what precedes a user's message in a chat prompt
    assistant: Text  # what precedes the model's reply

    def unique(self, rng: random.Random, tokens: int) -> Text:
        raise NotImplementedError

    def join(self, parts: Sequence[Text]) -> Text:
        """The concatenation of texts, with its ids."""
        ids = array("i")
        for p in parts:
            ids.extend(p.ids)
        return Text("".join(p.text for p in parts), ids)


class ChunkTextSource(TextSource):
    """English-like text (or the vocabulary's own words, for a WordLevel tokenizer)."""

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self.tokenizer = tokenizer
        rng = random.Random(f"epp-workload-text:{tokenizer.name}")
        if tokenizer.open_vocabulary:
            lex = corpus.lexicon()
            words = [" " + w for w in lex.words[:_WORDS]]
            word_weights = list(lex.cum_weights[:_WORDS])
            chunk_texts = [_chunk_text(rng, lex) for _ in range(_CHUNKS)]
        else:  # every other word would be one unknown token: use the vocabulary's words
            words = list(tokenizer.output_vocab)
            word_weights = list(itertools.accumulate(1.0 / (r + 1) for r in range(len(words))))
            chunk_texts = ["".join(rng.choices(words, cum_weights=word_weights, k=rng.randint(5, 40)))
                           for _ in range(_CHUNKS)]
        self._chunks = [_chunk(text, ids, starts)
                        for text, (ids, starts) in zip(chunk_texts, tokenizer.encode_with_starts(chunk_texts))]
        self._mean_chunk = max(1, sum(c.tokens for c in self._chunks) // len(self._chunks))
        self._words = [_Chunk(w, ids.tobytes(), len(ids), (len(w),), (len(ids),))
                       for w, ids in zip(words, tokenizer.encode_many(words))]
        self._word_weights = word_weights
        self._fill = [_Chunk(w, array("i", (i,)).tobytes(), 1, (len(w),), (1,))
                      for w, i in zip(tokenizer.output_vocab, tokenizer.output_ids)]
        self.user = self._encode(" User:")
        self.assistant = self._encode(" Assistant:")
        # The unit rule is exact for byte-level BPE and whitespace pre-tokenizers; check it here, so
        # an unusual tokenizer (e.g. SentencePiece's metaspace) is tokenized for real instead.
        self.exact = True
        sample = [self.join([self.user, self.unique(random.Random(0), 3), self.assistant])]
        sample += [self.unique(random.Random(i), 20 + 37 * i % 400) for i in range(_CHECK // 4)]
        for c in self._chunks[:_CHECK]:
            k = len(c.char_ends) // 2  # a cut chunk: its first units
            sample.append(Text(c.text[:c.char_ends[k]], _ids(c.ids[:4 * c.token_ends[k]])))
        self.exact = all(list(tokenizer.encode(t.text, add_special_tokens=False)) == list(t.ids) for t in sample)

    def _encode(self, text: str) -> Text:
        return Text(text, self.tokenizer.encode(text, add_special_tokens=False))

    def unique(self, rng: random.Random, tokens: int) -> Text:
        texts: list[str] = []
        blobs: list[bytes] = []
        total = 0
        # A few single words first: no two texts share their first block.
        for w in rng.choices(self._words, cum_weights=self._word_weights, k=min(_HEAD_WORDS, tokens)):
            if total + w.tokens > tokens:
                break
            texts.append(w.text)
            blobs.append(w.ids)
            total += w.tokens
        chunks = self._chunks
        while total < tokens:
            for c in rng.choices(chunks, k=(tokens - total) // self._mean_chunk + 1):
                if total + c.tokens <= tokens:
                    texts.append(c.text)
                    blobs.append(c.ids)
                    total += c.tokens
                    continue
                k = bisect.bisect_right(c.token_ends, tokens - total) - 1
                if k >= 0:
                    texts.append(c.text[:c.char_ends[k]])
                    blobs.append(c.ids[:4 * c.token_ends[k]])
                    total += c.token_ends[k]
                for w in rng.choices(self._fill, k=tokens - total):  # words of one token each
                    texts.append(w.text)
                    blobs.append(w.ids)
                total = tokens
                break
        ids = array("i")
        ids.frombytes(b"".join(blobs))
        text = Text("".join(texts), ids)
        return text if self.exact else self._encode(text.text)

    def join(self, parts: Sequence[Text]) -> Text:
        joined = TextSource.join(self, parts)
        return joined if self.exact else self._encode(joined.text)


class HexTextSource(TextSource):
    """`chars4`: random hex, 4 characters per token, as before real tokenizers (so earlier
    figures can be reproduced)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.user = self._encode("<|user|>")
        self.assistant = self._encode("<|asst|>")

    def _encode(self, text: str) -> Text:
        return Text(text, self.tokenizer.encode(text, add_special_tokens=False))

    def unique(self, rng: random.Random, tokens: int) -> Text:
        return self._encode(rng.randbytes(2 * tokens).hex())


@functools.lru_cache(maxsize=8)
def text_source(tokenizer: Tokenizer) -> TextSource:
    """The text source of a tokenizer (built once per process: a few hundred milliseconds)."""
    if isinstance(tokenizer, HfTokenizer):
        return ChunkTextSource(tokenizer)
    if isinstance(tokenizer, Chars4Tokenizer):
        return HexTextSource(tokenizer)
    raise TypeError(f"no workload text for tokenizer {tokenizer.name!r}")


def _chunk_text(rng: random.Random, lex: corpus.Lexicon) -> str:
    """A sentence, now and then two with a paragraph break, or a piece of code; starts with a
    space and ends with a non-space character."""
    u = rng.random()
    if u < 0.1:
        return " " + corpus.code(rng, lex)
    if u < 0.2:
        return " " + corpus.sentence(rng, lex) + "\n\n" + corpus.sentence(rng, lex)
    return " " + " ".join(corpus.sentence(rng, lex) for _ in range(rng.randint(1, 3)))


def _chunk(text: str, ids: array, starts: list[int]) -> _Chunk:
    """A chunk cut into units: a unit ends where the next begins; its tokens are those that start
    before that (none straddles a unit boundary when the rule holds, which __init__ checks)."""
    char_ends = [m.start() for m in _UNIT_START.finditer(text)] + [len(text)]
    token_ends = [bisect.bisect_left(starts, end) for end in char_ends]
    return _Chunk(text, ids.tobytes(), len(ids), tuple(char_ends), tuple(token_ends))


def _ids(data: bytes) -> array:
    ids = array("i")
    ids.frombytes(data)
    return ids
