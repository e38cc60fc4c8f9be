"""The three live workloads, as deterministic request plans (same seed → same requests per arm).

- `prefix`: groups of users share a long system prompt and hold multi-turn chats, so both the
  group's prompt and each user's own history can be served from one pod's prefix cache; the
  pods' KV cache is too small for every group on every pod, so where a request lands decides
  whether its prefill is paid again.
- `balance`: independent prompts of widely varied length: no shared prefixes, only load matters.
- `hol`: short interactive requests mixed with a few very long generations that hold batch
  slots for seconds (head-of-line blocking when they pile up on one pod).

Text is made of words that are one token each for the simulated pods' tokenizer (the shipped
byte-level BPE's single-token words, 2–9 characters), so prompt sizes below are in tokens.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from itertools import product
from string import ascii_lowercase

from epp.sim.tokens import DEFAULT_TOKENIZER, load_tokenizer

# 3-letter words (4 characters with a space): the vocabulary of the cost benchmarks' prompts,
# where characters count (each is ~2.3 tokens for the pods' BPE, so not for sizes in tokens).
WORDS: tuple[str, ...] = tuple("".join(p) for p in product(ascii_lowercase, repeat=3))[:4000]
CHAT = "/v1/chat/completions"
COMPLETION = "/v1/completions"


@dataclass(slots=True)
class Planned:
    """One request: when to send it (seconds from the start), where, and what."""

    at: float
    path: str
    body: dict[str, object]
    kind: str
    # Turns of one user go in order, each only after the previous one has finished.
    user: int | None = None


@dataclass(slots=True)
class Workload:
    name: str
    description: str
    plan: list[Planned] = field(default_factory=list)


@functools.cache
def _vocab() -> tuple[str, ...]:
    """Words of one token each (with their leading space) for the pods' default tokenizer."""
    return load_tokenizer(DEFAULT_TOKENIZER).output_vocab


def pod_words() -> tuple[str, ...]:
    """The single-token words without their leading space (the vocabulary of inference-perf's
    tokenizer, `bench/tokenizer.py`: its decoder puts the spaces back)."""
    return tuple(w.strip() for w in _vocab())


def words(rng: random.Random, n: int) -> str:
    """`n` tokens of text, as the pods count them."""
    return "".join(rng.choices(_vocab(), k=n)).lstrip()


def poisson_times(rng: random.Random, rate: float, duration: float) -> list[float]:
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return times
        times.append(t)


def lognormal_int(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal sample with the given mean (not median), clipped to [lo, hi]."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(lo, min(hi, int(rng.lognormvariate(mu, sigma))))


def prefix_heavy(rate: float, duration: float, seed: int = 1, groups: int = 12, users_per_group: int = 4,
                 system_tokens: int = 2000, turn_tokens: int = 60, reply_tokens: int = 80,
                 max_turns: int = 6) -> Workload:
    rng = random.Random(seed)
    systems = [f"You are assistant {g} of the ACME help desk. Policy: {words(rng, system_tokens)}"
               for g in range(groups)]
    users = groups * users_per_group
    histories: list[list[dict[str, str]]] = [[] for _ in range(users)]
    plan = []
    for at in poisson_times(rng, rate, duration):
        u = rng.randrange(users)
        history = histories[u]
        history.append({"role": "user", "content": f"user {u} asks: {words(rng, turn_tokens)}"})
        del history[:max(0, len(history) - (2 * max_turns - 1))]
        messages = [{"role": "system", "content": systems[u % groups]}, *history]
        body = {"messages": messages, "max_tokens": rng.randint(32, 96), "ignore_eos": True}
        plan.append(Planned(at, CHAT, body, "chat", user=u))
        # The reply the user "saw": the next turn carries it, as a chat client would.
        history.append({"role": "assistant", "content": words(rng, reply_tokens)})
    return Workload("prefix", f"{groups} system prompts of ~{system_tokens} tokens shared by "
                    f"{users_per_group} users each; multi-turn chats (≤{max_turns} turns kept, "
                    f"~{turn_tokens}-token questions, 32–96 output tokens)", plan)


def balance(rate: float, duration: float, seed: int = 2, mean_prompt: int = 800, mean_output: int = 80) -> Workload:
    rng = random.Random(seed)
    plan = []
    for i, at in enumerate(poisson_times(rng, rate, duration)):
        n = lognormal_int(rng, mean_prompt, 0.9, 32, 6000)
        out = lognormal_int(rng, mean_output, 0.8, 8, 768)
        body = {"prompt": f"request {i}: {words(rng, n)}", "max_tokens": out, "ignore_eos": True}
        plan.append(Planned(at, COMPLETION, body, "prompt"))
    return Workload("balance", f"independent prompts, lognormal lengths (mean {mean_prompt} tokens, "
                    f"32–6000) and outputs (mean {mean_output}, 8–768)", plan)


def head_of_line(rate: float, duration: float, seed: int = 3, long_share: float = 0.08,
                 long_tokens: tuple[int, int] = (400, 800)) -> Workload:
    rng = random.Random(seed)
    plan = []
    for i, at in enumerate(poisson_times(rng, rate, duration)):
        if rng.random() < long_share:
            body = {"prompt": f"long {i}: write a long story about {words(rng, 100)}",
                    "max_tokens": rng.randint(*long_tokens), "ignore_eos": True}
            plan.append(Planned(at, COMPLETION, body, "long"))
        else:
            body = {"prompt": f"short {i}: {words(rng, rng.randint(150, 600))}",
                    "max_tokens": rng.randint(16, 48), "ignore_eos": True}
            plan.append(Planned(at, COMPLETION, body, "short"))
    return Workload("hol", f"short requests (150–600 prompt tokens, 16–48 output) with {long_share:.0%} long "
                    f"generations ({long_tokens[0]}–{long_tokens[1]} output tokens)", plan)


BUILDERS = {"prefix": prefix_heavy, "balance": balance, "hol": head_of_line}
