"""Turns a `Workload` into requests: arrival times, tenants, prompt text, output lengths, chats.

Every class draws from its own random stream (seeded by the run seed and the class), so adding a
class does not change the others' requests, and every chat session from its own, so the order in
which turns finish (which depends on the policy under test) never changes what is sent.

Prompt text is English-like text made for the pods' tokenizer (`epp.sim.tokenizers.text`), with
its token ids known without tokenizing it: sizes in the workload are tokens of that tokenizer,
while the EPP sees only the text, as in production. A shared prefix (a system prompt) is one text
reused verbatim, a chat turn re-sends the conversation so far (`" User:"` / `" Assistant:"`
markers, the model's reply as it generated it); a completion's ids get the tokenizer's special
tokens (BOS), as vLLM adds them. Text is built only when a request arrives and dropped when it is
dispatched, so 100,000 requests need no more memory than the ones in flight.
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from epp.sim.cluster.workload import ClassSpec, Workload
from epp.sim.generation import token_ids, token_text
from epp.sim.request import Request
from epp.sim.tokenizers.text import Text, text_source
from epp.sim.tokens import Tokenizer, load_tokenizer


@dataclass(slots=True, eq=False)
class Session:
    """A multi-turn chat: its own random stream and the conversation so far."""

    rng: random.Random
    cls: int
    tenant: str
    lora: str | None
    conversation: Text  # everything sent so far, without special tokens
    turns_left: int


@dataclass(slots=True, eq=False)
class Job:
    """One request, from arrival to its end; the outcome fields are what reports read."""

    id: int
    cls: int
    tenant: str
    arrival: float
    prompt: str  # the text the EPP sees
    prompt_tokens: int
    output_tokens: int  # what the engine will generate (the request ends there)
    max_tokens: int  # what the body asks for
    lora: str | None = None
    session: Session | None = None
    turn: int = 0
    # What the engine computes: the prompt's token ids, special tokens included (until dispatch).
    prompt_ids: array | None = None
    # -- filled in as it runs --
    request: Request | None = None  # the engine's view, while in flight
    handle: Any = None  # the router's per-request state (the EPP's RequestRecord)
    pod: int = -1
    dispatch: float = -1.0
    first_token: float = -1.0
    finish: float = -1.0
    cached_tokens: int = 0
    generated: int = 0
    error: str = ""  # why it ended without being served ("" when it was)

    @property
    def ok(self) -> bool:
        return not self.error and self.finish >= 0


class Traffic:
    """Open-loop arrivals in time order (`next_arrival`) plus closed-loop chat turns (`follow_up`)."""

    def __init__(self, workload: Workload, *, pods: int, seed: int, max_model_len: int,
                 tokenizer: Tokenizer | None = None) -> None:
        self.workload = workload
        self.max_model_len = max_model_len
        self.seed = seed
        self.tokenizer = tokenizer or load_tokenizer(workload.tokenizer)
        self.text = text_source(self.tokenizer)
        self._specials = len(self.tokenizer.special_prefix) + len(self.tokenizer.special_suffix)
        self.created = 0
        self._limit = workload.max_requests or math.inf
        self._rngs = [random.Random(f"{seed}:class:{i}") for i in range(len(workload.classes))]
        self._prefixes: dict[tuple[int, int], Text] = {}
        self._sessions = 0
        self._heap: list[tuple[float, int, Iterator[float]]] = []
        for i, spec in enumerate(workload.classes):
            times = arrival_times(spec, pods, random.Random(f"{seed}:arrivals:{i}"), workload.duration)
            first = next(times, None)
            if first is not None:
                self._heap.append((first, i, times))
        heapq.heapify(self._heap)

    @property
    def exhausted(self) -> bool:
        """No open-loop arrival is left (chat sessions may still send turns)."""
        return not self._heap or self.created >= self._limit

    def peek_time(self) -> float | None:
        return None if self.exhausted else self._heap[0][0]

    def next_arrival(self) -> Job | None:
        """The next open-loop request (a single request, or a chat's first turn)."""
        if self.exhausted:
            return None
        t, i, times = self._heap[0]
        nxt = next(times, None)
        if nxt is None:
            heapq.heappop(self._heap)
        else:
            heapq.heapreplace(self._heap, (nxt, i, times))
        return self._new(i, t)

    def follow_up(self, job: Job, now: float) -> Job | None:
        """The next turn of `job`'s chat, arriving after a think time; None when the chat is over."""
        s = job.session
        if s is None or s.turns_left <= 0 or self.created >= self._limit or not job.ok:
            return None
        spec = self.workload.classes[s.cls]
        assert spec.chat is not None and job.request is not None
        tok = self.tokenizer
        salt = job.request.salt
        reply = Text(token_text(salt, 0, job.generated, tok.output_vocab),
                     token_ids(salt, 0, job.generated, tok.output_ids))
        message = self.text.unique(s.rng, spec.chat.message.sample_int(s.rng))
        conversation = self.text.join([s.conversation, self.text.assistant, reply, self.text.user, message])
        output = spec.output.sample_int(s.rng)
        if len(conversation) + len(self.text.assistant) + self._specials + output >= self.max_model_len:
            return None  # the conversation no longer fits the context window
        think = max(0.0, spec.chat.think_time.sample(s.rng))
        if now + think >= self.workload.duration:
            return None  # the run sends nothing after its duration, follow-ups included
        s.conversation = conversation
        s.turns_left -= 1
        return self._job(s.cls, now + think, s.tenant, self._ask(conversation), output, spec, s.lora, s,
                         job.turn + 1)

    def _ask(self, conversation: Text) -> Text:
        """A chat turn's prompt: the conversation, then the assistant's header the reply follows
        (as a chat template's generation prompt), so the next turn, which re-sends the reply after
        it, shares this turn's whole sequence, prompt and reply: vLLM caches both."""
        return self.text.join([conversation, self.text.assistant])

    # -- building requests --

    def _new(self, i: int, t: float) -> Job:
        spec = self.workload.classes[i]
        rng = self._rngs[i]
        tenant = spec.tenants.pick(rng.random()) if spec.tenants else ""
        lora = None
        if spec.lora is not None and rng.random() >= spec.lora.base:
            lora = spec.lora.adapters.pick(rng.random())
        prefix = self._prefix(i, spec, rng)
        output = spec.output.sample_int(rng)
        prefix_len = (len(prefix) if prefix else 0) + self._specials + (
            len(self.text.user) + len(self.text.assistant) if spec.chat else 0)
        room = self.max_model_len - output - 1 - prefix_len
        unique = min(spec.prompt.sample_int(rng), room)
        if unique < 1:  # the prefix alone fills the context: keep the prompt, shorten the output
            unique = 1
            output = max(1, self.max_model_len - 2 - prefix_len)
        parts = [prefix] if prefix else []
        if spec.chat:
            parts.append(self.text.user)
        parts.append(self.text.unique(rng, unique))
        text = self.text.join(parts)
        session = None
        if spec.chat is not None:
            self._sessions += 1
            srng = random.Random(f"{self.seed}:session:{i}:{self._sessions}")
            turns = spec.chat.turns.sample_int(srng)
            session = Session(srng, i, tenant, lora, text, turns - 1)
            text = self._ask(text)
        return self._job(i, t, tenant, text, output, spec, lora, session, 0)

    def _job(self, i: int, t: float, tenant: str, text: Text, output: int, spec: ClassSpec, lora: str | None,
             session: Session | None, turn: int) -> Job:
        self.created += 1
        max_tokens = max(output, spec.max_tokens or output)
        tok = self.tokenizer
        ids = tok.special_prefix + text.ids + tok.special_suffix if self._specials else text.ids
        return Job(id=self.created, cls=i, tenant=tenant, arrival=t, prompt=text.text, prompt_tokens=len(ids),
                   output_tokens=output, max_tokens=max_tokens, lora=lora, session=session, turn=turn,
                   prompt_ids=ids)

    def _prefix(self, i: int, spec: ClassSpec, rng: random.Random) -> Text | None:
        p = spec.prefix
        if p is None:
            return None
        if p.zipf > 0:
            weights = [1.0 / (g + 1) ** p.zipf for g in range(p.groups)]
            group = rng.choices(range(p.groups), weights)[0]
        else:
            group = rng.randrange(p.groups)
        text = self._prefixes.get((i, group))
        if text is None:
            grng = random.Random(f"{self.seed}:prefix:{i}:{group}")
            tokens = min(p.tokens.sample_int(grng), self.max_model_len // 2)
            text = self._prefixes[(i, group)] = self.text.unique(grng, tokens)
        return text


def arrival_times(spec: ClassSpec, pods: int, rng: random.Random, duration: float) -> Iterator[float]:
    """A class's arrival times in [start, min(stop, duration)), ascending."""
    a = spec.arrival
    start = spec.start
    stop = min(spec.stop if spec.stop is not None else math.inf, duration)
    if a.process == "burst":
        times = sorted(a.at + (rng.uniform(0.0, a.spread) if a.spread > 0 else 0.0) for _ in range(a.count))
        yield from times
        return
    rate = a.resolved_rate(pods)
    if rate <= 0:
        return
    t = start
    if a.process == "gamma":
        shape = 1.0 / (a.cv * a.cv)
        scale = 1.0 / (rate * shape)
        while True:
            t += rng.gammavariate(shape, scale)
            if t >= stop:
                return
            yield t
    period = a.on + a.off
    while True:
        t += rng.expovariate(rate)
        if a.process == "onoff" and a.off > 0:
            phase = (t - start) % period
            if phase >= a.on:  # in the off window: start afresh at the next on window
                t += period - phase
                continue
        if t >= stop:
            return
        yield t
