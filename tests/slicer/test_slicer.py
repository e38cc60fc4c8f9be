"""`epp slicer` over real HTTP in front of a simulated vLLM pod: a sliced response has the shape of
the pod's own unsliced one (the same keys in the same order, the same events), the usage sums the
slices, requests that cannot be sliced pass through once, and a client that goes away stops the
chain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from epp.cli import main
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.server import SimPod
from epp.slicer.server import Slicer

S = 16
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def served(pod: SimPod) -> int:
    """Requests the pod has ended (any way)."""
    return sum(pod.engine.finished_by_reason.values())


@pytest.fixture
async def pod() -> AsyncIterator[SimPod]:
    config = SimConfig(model="tiny", time_scale=0.02, engine=EngineConfig(max_model_len=1024))
    async with SimPod(config) as p:
        yield p


@pytest.fixture
async def slicer(pod: SimPod) -> AsyncIterator[str]:
    runner = web.AppRunner(Slicer(pod.url, slice_tokens=S).app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def shape(value: Any) -> Any:
    """Keys (in order) and value types, recursively: what a client's parser sees."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def body(path: str, **extra: Any) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"model": "tiny", "prompt": PROMPT, "ignore_eos": True, **extra}
    return {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True, **extra}


async def post(http: aiohttp.ClientSession, url: str, data: dict[str, Any]) -> tuple[int, bytes]:
    async with http.post(url, data=orjson.dumps(data), headers={"content-type": "application/json"}) as r:
        return r.status, await r.read()


def sse(data: bytes) -> list[Any]:
    out = []
    for part in data.split(b"\n\n"):
        if part:
            assert part.startswith(b"data: ")
            payload = part[6:]
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


def kind(event: Any, chat: bool) -> str:
    if event == "[DONE]":
        return "done"
    if not event["choices"]:
        return "usage"
    choice = event["choices"][0]
    if choice["finish_reason"] is not None:
        return "finish"
    return "role" if chat and "role" in choice["delta"] else "token"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_whole_response_of_five_slices_looks_like_one(pod: SimPod, slicer: str,
                                                             http: aiohttp.ClientSession, path: str) -> None:
    status, direct = await post(http, pod.url + path, body(path, max_tokens=70))
    assert status == 200
    before = served(pod)
    status, stitched = await post(http, slicer + path, body(path, max_tokens=70))
    assert status == 200
    assert served(pod) - before == 5  # 16 + 16 + 16 + 16 + 6 tokens
    one, many = orjson.loads(direct), orjson.loads(stitched)
    assert shape(many) == shape(one)
    assert many["usage"] == one["usage"]  # the client's prompt, all 70 tokens
    assert many["usage"]["completion_tokens"] == 70 and many["choices"][0]["finish_reason"] == "length"
    text = many["choices"][0]["text"] if path == "/v1/completions" else many["choices"][0]["message"]["content"]
    assert len(text.split()) == 70  # the simulator's tokens are words


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("usage", [True, False])
async def test_a_stream_of_slices_has_the_events_of_one_stream(pod: SimPod, slicer: str, http: aiohttp.ClientSession,
                                                              path: str, usage: bool) -> None:
    chat = path != "/v1/completions"
    extra: dict[str, Any] = {"max_tokens": 40, "stream": True}
    if usage:
        extra["stream_options"] = {"include_usage": True}
    _, direct = await post(http, pod.url + path, body(path, **extra))
    before = served(pod)
    status, stitched = await post(http, slicer + path, body(path, **extra))
    assert status == 200 and served(pod) - before == 3
    one, many = sse(direct), sse(stitched)
    kinds = [kind(e, chat) for e in many]
    assert kinds == [kind(e, chat) for e in one]  # role?, 40 tokens, finish, usage?, done
    for a, b in zip(one, many):
        assert shape(a) == shape(b)
    assert len({e["id"] for e in many if e != "[DONE]"}) == 1  # one response, one id
    if usage:
        assert many[-2]["usage"] == one[-2]["usage"] == {"prompt_tokens": one[-2]["usage"]["prompt_tokens"],
                                                          "total_tokens": many[-2]["usage"]["total_tokens"],
                                                          "completion_tokens": 40}


async def test_what_cannot_be_sliced_passes_through_once(pod: SimPod, slicer: str,
                                                         http: aiohttp.ClientSession) -> None:
    for data in (body("/v1/completions", max_tokens=40, n=2), body("/v1/completions", max_tokens=8),
                 body("/v1/completions", max_tokens=40, stop=["fox"])):
        before = served(pod)
        status, raw = await post(http, slicer + "/v1/completions", data)
        direct_status, direct = await post(http, pod.url + "/v1/completions", data)
        assert status == direct_status
        assert served(pod) - before == (2 if status == 200 else 0)  # once through the slicer, once direct
        assert shape(orjson.loads(raw)) == shape(orjson.loads(direct))
    async with http.get(slicer + "/v1/models") as r:  # every other path too
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"


async def test_an_error_of_the_first_slice_is_the_servers_own(pod: SimPod, slicer: str,
                                                              http: aiohttp.ClientSession) -> None:
    data = body("/v1/completions", max_tokens=40, model="nope")
    assert await post(http, slicer + "/v1/completions", data) == await post(http, pod.url + "/v1/completions", data)


async def test_a_full_context_ends_the_response_with_length(pod: SimPod, slicer: str,
                                                            http: aiohttp.ClientSession) -> None:
    prompt = " ".join(["the"] * 990)  # 990 of the pod's 1,024 tokens: room for 2 slices and a bit
    for stream in (False, True):
        status, raw = await post(http, slicer + "/v1/completions",
                                 {"model": "tiny", "prompt": prompt, "ignore_eos": True, "stream": stream})
        assert status == 200
        if stream:
            events = sse(raw)
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        else:
            assert orjson.loads(raw)["choices"][0]["finish_reason"] == "length"


async def test_a_client_that_goes_away_between_slices_stops_the_chain(pod: SimPod, slicer: str) -> None:
    pod.config.time_scale = 0.5  # slow enough to leave in the middle
    before = served(pod)
    data = body("/v1/completions", max_tokens=S * 40, stream=True)
    async with aiohttp.ClientSession() as http:
        async with http.post(slicer + "/v1/completions", data=orjson.dumps(data)) as r:
            seen = 0
            async for line in r.content:
                if line.startswith(b"data: {"):
                    seen += 1
                if seen > S + 2:  # into the second slice
                    break
        # leaving the blocks closes the connection
    await asyncio.sleep(1.0)
    assert served(pod) - before <= 3  # the slice in flight is aborted; no further slice is sent
    assert not pod.engine.requests  # nothing left running on the pod


async def test_the_slicers_metrics_count_what_it_did(pod: SimPod, slicer: str, http: aiohttp.ClientSession) -> None:
    await post(http, slicer + "/v1/completions", body("/v1/completions", max_tokens=40))
    await post(http, slicer + "/v1/completions", body("/v1/completions", max_tokens=4))
    async with http.get(slicer + "/metrics") as r:
        text = await r.text()
    assert 'epp_slicer_requests_total{outcome="sliced"} 1.0' in text
    assert 'epp_slicer_requests_total{outcome="passthrough"} 1.0' in text
    assert "epp_slicer_slices_total 3.0" in text


def test_bad_arguments_get_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slicer", "--upstream", "gateway:8080"]) == 2
    assert "--upstream: expected http://host:port" in capsys.readouterr().err
    assert main(["slicer", "--upstream", "http://gw:8080", "--slice-tokens", "0"]) == 2
