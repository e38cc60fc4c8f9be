"""Download-free deterministic tokenisation: 4 characters are one token.

Identical text prefixes give identical token blocks, so prefix caching behaves as with a real
tokenizer without shipping one. Block hashes are xxhash3 chained over fixed-width text slices
(UTF-32, so every character has the same width and a prefix of the text is a prefix of the bytes),
all in C: one hash call per 16-token block, no per-character Python work.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

CHARS_PER_TOKEN = 4
_BYTES_PER_CHAR = 4  # UTF-32-LE
_hash = xxhash.xxh3_64_intdigest


def namespace_seed(name: str) -> int:
    """Hash seed of a model or LoRA adapter: different adapters never share cached blocks."""
    return _hash(name.encode("utf-8"))


def count_text_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def text_block_hashes(text: str, block_size: int, seed: int, max_blocks: int | None = None) -> list[int]:
    """Chained hashes of the full token blocks of `text` (the partial tail block is not hashed)."""
    chars_per_block = block_size * CHARS_PER_TOKEN
    n = len(text) // chars_per_block
    if max_blocks is not None and n > max_blocks:
        n = max_blocks
    if n == 0:
        return []
    data = memoryview(text[: n * chars_per_block].encode("utf-32-le"))
    step = chars_per_block * _BYTES_PER_CHAR
    out: list[int] = []
    h = seed
    for off in range(0, n * step, step):
        h = _hash(data[off:off + step], seed=h)
        out.append(h)
    return out


def token_id_block_hashes(ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Chained hashes of the full blocks of a prompt given as token ids (non-negative ints < 2**63)."""
    n = len(ids) // block_size
    if n == 0:
        return []
    data = memoryview(array("q", ids[: n * block_size]).tobytes())
    step = block_size * 8
    out: list[int] = []
    h = seed ^ 0x9E3779B97F4A7C15  # keep id blocks apart from text blocks
    for off in range(0, n * step, step):
        h = _hash(data[off:off + step], seed=h)
        out.append(h)
    return out


def render_chat(messages: Sequence[dict[str, object]]) -> str:
    """Llama-3-style chat template, so turn n+1's prompt starts with turn n's prompt."""
    parts = ["<|begin_of_text|>"]
    for m in messages:
        parts.append(f"<|start_header_id|>{m.get('role', '')}<|end_header_id|>\n\n")
        parts.append(message_text(m.get("content")))
        parts.append("<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def message_text(content: object) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content
                       if isinstance(p, dict) and p.get("type") == "text")
    return ""
