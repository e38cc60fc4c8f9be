"""An async streaming client that replays a request plan and times every token.

It measures what a user sees: time to first token (the first SSE event that carries text),
the gaps between token events (inter-token latency) and end-to-end time, per request. Arrivals
are open loop (the planned times), except that one user's turns are sequential: a turn is sent at
its planned time or when the user's previous turn has finished, whichever is later, as a person in
a chat would. Past saturation users therefore fall behind; turns that would start after the end of
the run are not sent and are counted.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.workloads import Planned


@dataclass(slots=True)
class Outcome:
    kind: str
    sent: float  # seconds from the start of the run
    status: int = 0  # HTTP status; 0: connection error; -1: cut off at the end of the drain
    ttft: float = float("nan")
    e2e: float = float("nan")
    tokens: int = 0
    itls: list[float] = field(default_factory=list)
    complete: bool = False  # saw [DONE]

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.complete


@dataclass(slots=True)
class RunResult:
    outcomes: list[Outcome]
    start: float  # time.monotonic() at t=0 of the plan
    not_sent: int  # turns skipped because their user fell behind the end of the run


def _text_of(event: dict) -> str:  # type: ignore[type-arg]
    choices = event.get("choices") or ()
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if delta is not None:
        return delta.get("content") or ""
    return choice.get("text") or ""


async def _send(session: aiohttp.ClientSession, url: str, model: str, item: Planned, t0: float,
                outcomes: list[Outcome]) -> None:
    now = time.perf_counter()
    out = Outcome(item.kind, now - t0)
    outcomes.append(out)
    body = orjson.dumps({"model": model, **item.body, "stream": True})
    headers = {"content-type": "application/json"}
    if item.user is not None:
        # What a chat client sends; session-aware routers (vllm-router's sticky/consistent-hash) key on it.
        headers["x-session-id"] = f"user-{item.user}"
    try:
        async with session.post(url + item.path, data=body, headers=headers) as r:
            out.status = r.status
            if r.status != 200:
                await r.read()
                return
            last = 0.0
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    out.complete = True
                    break
                if not _text_of(orjson.loads(payload)):
                    continue
                t = time.perf_counter()
                if out.tokens == 0:
                    out.ttft = t - now
                else:
                    out.itls.append(t - last)
                last = t
                out.tokens += 1
    except (aiohttp.ClientError, orjson.JSONDecodeError, asyncio.TimeoutError):
        out.status = out.status or 0
        out.complete = False
    except asyncio.CancelledError:
        out.status = -1
        raise
    finally:
        out.e2e = time.perf_counter() - now


async def replay(url: str, model: str, plan: list[Planned], duration: float, drain: float) -> RunResult:
    """Send `plan` against `url`; wait at most `drain` seconds after `duration` for stragglers."""
    outcomes: list[Outcome] = []
    by_user: dict[int, list[Planned]] = defaultdict(list)
    independent: list[Planned] = []
    for item in plan:
        (by_user[item.user] if item.user is not None else independent).append(item)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        start = time.monotonic()
        tasks: list[asyncio.Task[None]] = []

        async def user_loop(items: list[Planned]) -> None:
            for item in items:
                delay = t0 + item.at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() - t0 >= duration:
                    return
                await _send(session, url, model, item, t0, outcomes)

        async def independent_loop() -> None:
            for item in independent:
                delay = t0 + item.at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_send(session, url, model, item, t0, outcomes)))

        senders = [asyncio.create_task(user_loop(items)) for items in by_user.values()]
        senders.append(asyncio.create_task(independent_loop()))
        try:
            _, pending = await asyncio.wait(senders, timeout=max(0.0, duration - (time.perf_counter() - t0)) + 0.05)
            # The independent loop has sent everything by now; the drain covers all in-flight requests.
            everything = [*pending, *tasks]
            remaining = t0 + duration + drain - time.perf_counter()
            if everything:
                await asyncio.wait(everything, timeout=max(0.0, remaining))
        finally:
            stragglers = [t for t in [*senders, *tasks] if not t.done()]
            for t in stragglers:
                t.cancel()
            await asyncio.gather(*stragglers, return_exceptions=True)
    return RunResult(outcomes, start, len(plan) - len(outcomes))
