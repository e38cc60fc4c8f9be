"""Builds engine Requests from prompts, chat messages or bare token counts.

One place decides how text becomes tokens and blocks and how long the output is, so the HTTP pods
and a virtual-time cluster see identical requests for identical input. Text is tokenized with the
pod's tokenizer as vLLM does it (`epp.sim.tokens`): a completion prompt with the tokenizer's
special tokens, a chat with its template; the prompt's block hashes are vLLM's, from the ids
(`epp.sim.block_hash`), with the adapter and `cache_salt` in them.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from typing import Any

import xxhash

from epp.sim.block_hash import hash_blocks
from epp.sim.config import SimConfig
from epp.sim.generation import OutputSampler
from epp.sim.request import Request
from epp.sim.tokens import Tokenizer, load_tokenizer, namespace_seed


class RequestFactory:
    """Makes Requests for one pod (or one simulated engine) with seeded output lengths."""

    __slots__ = ("config", "tokenizer", "_sampler", "_seeds", "_ids")

    def __init__(self, config: SimConfig, seed: int | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer)
        self._sampler = OutputSampler(config.mean_output_tokens, config.seed if seed is None else seed)
        self._seeds: dict[str, int] = {}
        self._ids = itertools.count()

    def seed_for(self, lora: str | None) -> int:
        name = lora or self.config.model
        s = self._seeds.get(name)
        if s is None:
            s = self._seeds[name] = namespace_seed(name)
        return s

    def default_max_tokens(self, prompt_len: int) -> int:
        room = self.config.engine.max_model_len - prompt_len
        return max(1, min(self.config.default_max_tokens, room))

    def from_text(self, text: str, *, max_tokens: int | None = None, ignore_eos: bool = False,
                  priority: int = 0, lora: str | None = None, arrival_time: float = 0.0,
                  request_id: str | None = None, cache_salt: str | None = None) -> Request:
        """A completion of a text prompt (tokenized with the tokenizer's special tokens, e.g. BOS)."""
        return self.from_token_ids(self.tokenizer.encode(text, add_special_tokens=True), max_tokens=max_tokens,
                                   ignore_eos=ignore_eos, priority=priority, lora=lora,
                                   arrival_time=arrival_time, request_id=request_id, cache_salt=cache_salt)

    def from_token_ids(self, ids: Sequence[int] | array, *, max_tokens: int | None = None,
                       ignore_eos: bool = False, priority: int = 0, lora: str | None = None,
                       arrival_time: float = 0.0, request_id: str | None = None,
                       cache_salt: str | None = None) -> Request:
        """A completion of a prompt given as token ids (used as given)."""
        prompt = ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)
        hashes = hash_blocks(prompt, self.config.engine.block_size, lora=lora, cache_salt=cache_salt)
        req = self._make(len(prompt), hashes, max_tokens, ignore_eos, priority, lora, arrival_time,
                         request_id)
        req.prompt_token_ids = prompt
        req.cache_salt = cache_salt
        req.output_id_table = self.tokenizer.output_ids
        return req

    def from_messages(self, messages: Sequence[dict[str, Any]], **kw: Any) -> Request:
        """A chat completion: the messages rendered with the tokenizer's chat template."""
        return self.from_token_ids(self.tokenizer.encode_chat(messages), **kw)

    def synthetic(self, prompt_len: int, output_len: int, *, prefix_len: int = 0,
                  prefix_key: int = 0, priority: int = 0, lora: str | None = None,
                  arrival_time: float = 0.0, request_id: str | None = None,
                  max_tokens: int | None = None) -> Request:
        """A request of given sizes without text; the first `prefix_len` tokens are shared by all
        requests with the same `prefix_key` (and adapter), the rest are unique."""
        bs = self.config.engine.block_size
        seed = self.seed_for(lora)
        hashes: list[int] = []
        h = seed
        shared_blocks = min(prefix_len, prompt_len) // bs
        for j in range(shared_blocks):
            h = xxhash.xxh3_64_intdigest(b"p%d:%d" % (prefix_key, j), seed=h)
            hashes.append(h)
        unique = self._sampler.salt()
        for j in range(shared_blocks, prompt_len // bs):
            h = xxhash.xxh3_64_intdigest(b"u%d:%d" % (unique, j), seed=h)
            hashes.append(h)
        req = self._make(prompt_len, hashes, max_tokens if max_tokens is not None else output_len,
                         True, priority, lora, arrival_time, request_id)
        req.output_len = min(output_len, req.max_tokens)
        return req

    def _make(self, prompt_len: int, hashes: list[int], max_tokens: int | None, ignore_eos: bool,
              priority: int, lora: str | None, arrival_time: float, request_id: str | None) -> Request:
        if max_tokens is None:
            max_tokens = self.default_max_tokens(prompt_len)
        room = self.config.engine.max_model_len - prompt_len
        if 0 < room < max_tokens:
            max_tokens = room  # vLLM silently shortens max_tokens when the prompt fits
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return Request(
            request_id=rid,
            prompt_len=prompt_len,
            block_hashes=hashes,
            max_tokens=max_tokens,
            output_len=self._sampler.output_len(max_tokens, ignore_eos),
            arrival_time=arrival_time,
            priority=priority,
            lora=lora,
            salt=self._sampler.salt(),
        )
