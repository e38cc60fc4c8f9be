"""Deterministic tokenisation and prefix hashing (4 characters per token)."""

from __future__ import annotations

from epp.sim.config import EngineConfig, SimConfig
from epp.sim.driver import run
from epp.sim.engine import Engine
from epp.sim.factory import RequestFactory
from epp.sim.generation import OutputSampler, token_piece, token_text
from epp.sim.tokens import count_text_tokens, render_chat, text_block_hashes, token_id_block_hashes


def test_token_count_is_chars_over_four() -> None:
    assert count_text_tokens("") == 0
    assert count_text_tokens("abcd") == 1
    assert count_text_tokens("abcde") == 2
    assert count_text_tokens("é" * 8) == 2


def test_shared_text_prefix_gives_shared_blocks_even_with_unicode() -> None:
    prefix = "Grüße aus Köln, 東京 " * 20  # non-ASCII on purpose
    a = text_block_hashes(prefix + "first ending", 16, seed=1)
    b = text_block_hashes(prefix + "a different ending that is longer", 16, seed=1)
    full = len(prefix) // 64
    assert full >= 4 and a[:full] == b[:full]
    assert text_block_hashes(prefix, 16, seed=2)[:full] != a[:full]  # other model/adapter
    assert len(text_block_hashes("x" * 63, 16, seed=1)) == 0  # partial blocks are not hashed


def test_token_id_prompts_hash_per_block() -> None:
    ids = list(range(100))
    h = token_id_block_hashes(ids, 16, seed=5)
    assert len(h) == 6
    assert token_id_block_hashes(ids[:40] + [0] * 60, 16, seed=5)[:2] == h[:2]


def test_next_chat_turn_reuses_the_previous_turn_from_cache() -> None:
    cfg = SimConfig()
    eng = Engine(cfg.engine)
    f = RequestFactory(cfg)
    turn1 = [{"role": "system", "content": "You answer questions about trains. " * 20},
             {"role": "user", "content": "When does the first train leave?"}]
    r1 = f.from_messages(turn1, max_tokens=16, ignore_eos=True, arrival_time=0.0)
    run(eng, [r1])
    reply = token_text(r1.salt, 0, r1.num_output_tokens)
    turn2 = [*turn1, {"role": "assistant", "content": reply},
             {"role": "user", "content": "And the last one?"}]
    r2 = f.from_messages(turn2, max_tokens=16, ignore_eos=True, arrival_time=1.0)
    run(eng, [r2])
    assert render_chat(turn2).startswith(render_chat(turn1))
    assert r2.num_cached_tokens == (len(render_chat(turn1)) // 64) * 16


def test_generated_text_is_four_characters_per_token() -> None:
    text = token_text(12345, 0, 50)
    assert len(text) == 200 and count_text_tokens(text) == 50
    assert "".join(token_piece(12345, i) for i in range(50)) == text


def test_output_lengths_are_seeded_and_capped() -> None:
    a = OutputSampler(100, seed=3)
    b = OutputSampler(100, seed=3)
    la = [a.output_len(256, False) for _ in range(2000)]
    assert la == [b.output_len(256, False) for _ in range(2000)]
    assert 1 <= min(la) and max(la) <= 256
    assert 80 < sum(la) / len(la) < 100  # geometric mean 100, capped at 256
    assert a.output_len(77, True) == 77


def test_max_tokens_defaults_and_caps() -> None:
    cfg = SimConfig(default_max_tokens=256, engine=EngineConfig(max_model_len=1024))
    f = RequestFactory(cfg)
    assert f.from_text("a" * 400).max_tokens == 256
    assert f.from_text("a" * 4000).max_tokens == 24  # 1000-token prompt: room for 24
    assert f.from_text("a" * 400, max_tokens=2000).max_tokens == 924
