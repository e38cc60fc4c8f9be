"""Text → token ids the way the simulated engine's tokenizer does it.

A `Tokenizer` is what the simulator needs of one: prompt ids as vLLM makes them (completions get
the tokenizer's special tokens, e.g. BOS; chat prompts are the chat template's text tokenized
without them), the longest token in characters (vLLM's cheap length pre-check), and the pieces
generated text is made of (words that are one token each, so a generated text re-tokenizes to
the number of tokens generated).

Three come with the package (`load_tokenizer`):

- `bpe` (the default): the project's byte-level BPE (`epp/sim/tokenizers/`), characters per
  token vary as in natural text;
- `tiny`: the WordLevel tokenizer of the model the real vLLM captures were made with;
- `chars4`: the old fixed rule, 4 characters are one token (ids are the 4 characters' bytes), so
  text blocks and token blocks line up exactly — only for comparing with earlier figures;

or a directory with a Hugging Face `tokenizer.json` (and optionally `tokenizer_config.json`,
`chat_template.jinja`).
"""

from __future__ import annotations

import functools
import json
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import xxhash
from tokenizers import Tokenizer as HfBackend
from tokenizers.models import WordLevel

from epp.api.chat_template import ChatTemplateError, render_chat

TOKENIZER_NAMES = ("bpe", "tiny", "chars4")
DEFAULT_TOKENIZER = "bpe"
NO_CHAT_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you "
                    "must provide a chat template if the tokenizer does not define one.")
_OUTPUT_VOCAB = 2048  # single-token words generated text is drawn from
_ENCODE_CACHE = 256  # repeated prompt texts remembered per tokenizer ...
_ENCODE_CACHE_CHARS = 65536  # ... when they are no longer than this (memory stays bounded)
_hash = xxhash.xxh3_64_intdigest


def namespace_seed(name: str) -> int:
    """Hash seed of a model or LoRA adapter (for requests built from sizes, without tokens)."""
    return _hash(name.encode("utf-8"))


class Tokenizer:
    """The interface; `HfTokenizer` and `Chars4Tokenizer` implement it."""

    name: str
    # The longest vocabulary entry in characters: vLLM rejects text longer than this times the
    # context length before tokenizing it.
    max_chars_per_token: int
    # Prompt ids above this are "out of vocabulary" (vLLM: the larger of the tokenizer's largest id
    # and the model's vocabulary size - 1, from the model's config.json when there is one).
    max_token_id: int
    # What `add_special_tokens` puts around a prompt's own ids (e.g. BOS in front).
    special_prefix: array
    special_suffix: array
    # Generated text is made of these pieces, each exactly one token (`output_ids`).
    output_vocab: tuple[str, ...]
    output_ids: array
    # False when words outside the vocabulary become one unknown token (WordLevel): workload text
    # must then be made of `output_vocab` words, or every prompt would look alike.
    open_vocabulary: bool = True

    def encode(self, text: str, add_special_tokens: bool = True) -> array:
        """Token ids (array of int32) of `text`; treat the result as read-only (it may be cached)."""
        raise NotImplementedError

    def encode_many(self, texts: Sequence[str]) -> list[array]:
        """Ids of each text, without special tokens."""
        return [self.encode(t, add_special_tokens=False) for t in texts]

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat prompt text (to be encoded with add_special_tokens=False)."""
        raise NotImplementedError

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> array:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


class HfTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (the `tokenizers` library, in Rust) with its chat template."""

    def __init__(self, name: str, backend: HfBackend, *, chat_template: str | None = None,
                 bos_token: str = "", eos_token: str = "", model_vocab_size: int = 0) -> None:
        self.name = name
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        vocab = backend.get_vocab(with_added_tokens=True)
        self.max_chars_per_token = max(len(t) for t in vocab)
        self.max_token_id = max(max(vocab.values()), model_vocab_size - 1)
        self.open_vocabulary = not isinstance(backend.model, WordLevel)
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        at = next(i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain)
        self.special_prefix = array("i", full[:at])
        self.special_suffix = array("i", full[at + len(plain):])
        self.output_vocab, self.output_ids = self._output_words(vocab)
        self._cache: OrderedDict[tuple[str, bool], array] = OrderedDict()

    @classmethod
    def from_dir(cls, path: Path, name: str | None = None) -> HfTokenizer:
        """`tokenizer.json` plus, when present, `tokenizer_config.json` (BOS/EOS, chat template),
        `chat_template.jinja` (which wins, as in transformers) and the model's `config.json`
        (its vocabulary size)."""
        backend = HfBackend.from_file(str(path / "tokenizer.json"))
        config = _json_file(path / "tokenizer_config.json")
        template = _config_template(config.get("chat_template"))
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        vocab_size = _json_file(path / "config.json").get("vocab_size")
        return cls(name or str(path), backend, chat_template=template,
                   bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")),
                   model_vocab_size=vocab_size if isinstance(vocab_size, int) else 0)

    def _output_words(self, vocab: dict[str, int]) -> tuple[tuple[str, ...], array]:
        """The most frequent (lowest-id) words that are one token with a leading space."""
        words: list[str] = []
        ids = array("i")
        special = set(self.backend.get_added_tokens_decoder())
        for tid in sorted(vocab.values()):
            if tid in special:
                continue
            text = self.backend.decode([tid]).strip()
            if len(text) < 2 or not text.isalnum() or not text.isascii():
                continue
            piece = " " + text
            if self.backend.encode(piece, add_special_tokens=False).ids != [tid]:
                continue
            words.append(piece)
            ids.append(tid)
            if len(words) == _OUTPUT_VOCAB:
                break
        if not words:
            raise ValueError(f"tokenizer {self.name}: no single-token words to generate text from")
        return tuple(words), ids

    def encode(self, text: str, add_special_tokens: bool = True) -> array:
        key = (text, add_special_tokens)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        ids = array("i", self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        if len(text) <= _ENCODE_CACHE_CHARS:
            self._cache[key] = ids
            if len(self._cache) > _ENCODE_CACHE:
                self._cache.popitem(last=False)
        return ids

    def encode_many(self, texts: Sequence[str]) -> list[array]:
        return [array("i", e.ids) for e in self.backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def encode_with_starts(self, texts: Sequence[str]) -> list[tuple[array, list[int]]]:
        """Ids of each text (no special tokens) and the character offset each token starts at."""
        out = []
        for e in self.backend.encode_batch(list(texts), add_special_tokens=False):
            out.append((array("i", e.ids), [start for start, _ in e.offsets]))
        return out

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(NO_CHAT_TEMPLATE)
        return render_chat(self.chat_template, messages, self.bos_token, self.eos_token,
                           add_generation_prompt=add_generation_prompt)


class Chars4Tokenizer(Tokenizer):
    """Every 4 characters are one token; an ASCII token's id is its 4 bytes (little-endian int32,
    so one C call tokenizes a whole ASCII text), any other token's a hash of its text."""

    CHARS = 4
    name = "chars4"
    max_chars_per_token = CHARS
    max_token_id = 2**31 - 1
    special_prefix = array("i")
    special_suffix = array("i")

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template
        self.bos_token = "<|begin_of_text|>"
        self.output_vocab = _CHARS4_VOCAB
        self.output_ids = array("i", (self.encode(w)[0] for w in _CHARS4_VOCAB))

    def encode(self, text: str, add_special_tokens: bool = True) -> array:
        if text.isascii():
            return _ascii_ids(text)
        ids = array("i")
        for i in range(0, len(text), self.CHARS):
            token = text[i:i + self.CHARS]
            if token.isascii():
                ids.extend(_ascii_ids(token))
            else:
                ids.append(0x7F000000 | (_hash(token.encode()) & 0xFFFFFF))
        return ids

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return render_chat(self.chat_template, messages, self.bos_token, "<|eot_id|>",
                           add_generation_prompt=add_generation_prompt)


def _ascii_ids(text: str) -> array:
    """4 ASCII characters per id, zero-padded (every id non-negative: ASCII bytes are < 0x80)."""
    data = text.encode("ascii")
    ids = array("i")
    ids.frombytes(data + b"\0" * (-len(data) % Chars4Tokenizer.CHARS))
    if sys.byteorder == "big":
        ids.byteswap()
    return ids


# Each a space and three letters: generated text re-tokenizes to the same count at 4 characters.
_CHARS4_VOCAB: tuple[str, ...] = tuple(" " + w for w in (
    "the and for are but not you all any can her was one our out day get has him his how man new "
    "now old see two way who boy did its let put say she too use art bed big box cat cup dog ear "
    "eye fox fun hat ice jam key leg map net owl pen red sea sky sun tea top van web yes zoo arm "
    "bag bus car cow fan gas hen ink job kid lab mud oak pig rat row saw toy war wax").split())


def _json_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str:
    """A special token in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _config_template(value: object) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named templates (take "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def shipped_dir(name: str) -> Path:
    return Path(str(resources.files("epp.sim.tokenizers").joinpath(name)))


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """A shipped tokenizer by name (`bpe`, `tiny`, `chars4`) or a directory with a tokenizer.json
    (loaded once per process and shared: tokenizers are read-only apart from their caches)."""
    if spec == "chars4":
        return Chars4Tokenizer((shipped_dir("bpe") / "chat_template.jinja").read_text(encoding="utf-8"))
    if spec in TOKENIZER_NAMES:
        return HfTokenizer.from_dir(shipped_dir(spec), name=spec)
    path = Path(spec)
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer {spec!r}: not one of {', '.join(TOKENIZER_NAMES)} nor a directory "
                         "with a tokenizer.json")
    try:
        return HfTokenizer.from_dir(path)
    except Exception as e:  # the Rust loader raises plain Exception
        raise ValueError(f"tokenizer {spec!r}: cannot load: {e}") from None
