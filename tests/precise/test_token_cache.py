"""The tokenization cache is exact: the same ids as tokenizing the whole prompt, for real
tokenizer families (the fixture's WordLevel, byte-level BPE, Metaspace BPE, WordPiece)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from epp.api.token_cache import PrefixTokenCache
from tests.precise.helpers import MODEL_DIR

WORDS = ("the quick brown fox jumps over lazy dog hello tok system user assistant you are a helpful "
         "customer contract clause section invoice délai naïve 東京 😀 don't it's 1234 3.14 foo_bar x=y; "
         "(paren) [brack] {brace} http://example.com/a?b=c").split()
PUNCT = [" ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ", "! ", "-", "'s ", ""]


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(PUNCT) for _ in range(n))


def _train(model: models.Model, trainer: trainers.Trainer, pre: pre_tokenizers.PreTokenizer,
           normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    rng = random.Random(0)
    tok.train_from_iterator([text(rng, 40) for _ in range(400)], trainer=trainer)
    return tok


def tokenizers() -> dict[str, Tokenizer]:
    byte_bpe = _train(models.BPE(), trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
                      pre_tokenizers.ByteLevel(add_prefix_space=False))
    byte_bpe.decoder = decoders.ByteLevel()
    metaspace = _train(models.BPE(unk_token="<unk>"), trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"]),
                       pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"))
    wordpiece = _train(models.WordPiece(unk_token="[UNK]"), trainers.WordPieceTrainer(vocab_size=600, special_tokens=["[UNK]"]),
                       pre_tokenizers.BertPreTokenizer(), normalizers.BertNormalizer(lowercase=True))
    return {"fixture-wordlevel": Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")),
            "byte-level-bpe": byte_bpe, "metaspace-bpe": metaspace, "wordpiece": wordpiece}


TOKENIZERS = tokenizers()


def cache_for(tok: Tokenizer, **kw: int) -> PrefixTokenCache:
    def encode(t: str) -> tuple[list[int], list[tuple[int, int]]]:
        e = tok.encode(t, add_special_tokens=False)
        return e.ids, e.offsets
    return PrefixTokenCache(encode, **kw)


def whole(tok: Tokenizer, t: str) -> list[int]:
    return tok.encode(t, add_special_tokens=False).ids


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_growing_chat_is_exact_and_served_from_the_cache(name: str) -> None:
    tok = TOKENIZERS[name]
    cache = cache_for(tok, block_chars=256)
    rng = random.Random(1)
    prompt = text(rng, 300)
    for turn in range(12):
        prompt += text(rng, rng.randrange(1, 80))
        result = cache.lookup(prompt)
        ids, reused = result.ids, result.reused_chars
        assert list(ids) == whole(tok, prompt), f"turn {turn}"
        if turn:
            assert reused > len(prompt) // 2  # most of the prompt came from the cache
            assert result.prefix_serial == result.serial - 1  # it extended the previous turn
            assert list(ids[:result.shared_tokens]) == previous[:result.shared_tokens]
        previous = list(ids)
    assert cache.stats.hits >= 10


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_shared_prefix_with_different_suffixes_is_exact(name: str) -> None:
    tok = TOKENIZERS[name]
    cache = cache_for(tok, block_chars=64, margin=32, lead=32, converge_tokens=4)
    rng = random.Random(2)
    system = text(rng, 200)
    for _ in range(60):
        # suffixes that start mid-word, mid-space run, or right at the boundary
        cut = rng.randrange(len(system) // 2, len(system))
        prompt = system[:cut] + rng.choice(["", "x", " ", "  ", "\n"]) + text(rng, rng.randrange(0, 30))
        assert list(cache.tokenize(prompt)[0]) == whole(tok, prompt)
    assert cache.stats.hits > 30


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_adversarial_boundaries(name: str) -> None:
    """Long words, long space runs and digit runs across the cut are caught by the check."""
    tok = TOKENIZERS[name]
    cache = cache_for(tok, block_chars=64, margin=16, lead=16, converge_tokens=2)
    rng = random.Random(3)
    base = text(rng, 100)
    for filler in ("a" * 300, " " * 300, "1" * 300, "😀" * 200, "ab" * 150, "\n" * 200):
        for extra in ("", "b", " c", "2", "a"):
            prompt = base + filler
            assert list(cache.tokenize(prompt)[0]) == whole(tok, prompt)
            prompt2 = prompt + extra + text(rng, 5)
            assert list(cache.tokenize(prompt2)[0]) == whole(tok, prompt2)


def test_memory_is_bounded_and_collisions_are_checked() -> None:
    tok = TOKENIZERS["fixture-wordlevel"]
    cache = cache_for(tok, max_tokens=5000)
    rng = random.Random(4)
    for _ in range(20):
        cache.tokenize(" ".join(f"w{rng.randrange(2000)}" for _ in range(1000)))
    assert cache.tokens <= 5000
    # A forged hash entry pointing at other text must not be used (the memcmp check).
    a = " ".join(f"w{i}" for i in range(2000))
    b = " ".join(f"w{i + 1}" for i in range(2000))
    cache.tokenize(a)
    table = cache._by_block[1]
    entry = next(iter(table.values()))
    for key in list(table):
        table[key] = entry
    assert list(cache.tokenize(b)[0]) == whole(tok, b)


def test_non_ascii_offsets_are_characters() -> None:
    tok = TOKENIZERS["byte-level-bpe"]
    cache = cache_for(tok, block_chars=32, margin=16, lead=16, converge_tokens=2)
    prompt = "délai naïve 東京 😀 " * 60
    cache.tokenize(prompt)
    longer = prompt + "the quick brown fox"
    ids, reused = cache.tokenize(longer)
    assert list(ids) == whole(tok, longer) and reused > 0
