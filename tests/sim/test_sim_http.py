"""Simulated pods over real HTTP, compared with the real vLLM 0.32 captures."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.sim.config import EngineConfig, SimConfig
from epp.sim.server import SimPod, start_pods, stop_pods
from epp.sim.tokens import load_tokenizer

LONG = " ".join(f"w{i % 2000}" for i in range(1100))
SHORT = " ".join(["the"] * 1100)
IDS = [11] * 1100


def tiny_config(**engine_kw: Any) -> SimConfig:
    """Like the captured server: served name "tiny", max_model_len 1024, its tokenizer and the
    chat template of run A."""
    time_scale = engine_kw.pop("time_scale", 0.01)
    loras = engine_kw.pop("loras", ())
    tokenizer = engine_kw.pop("tokenizer", "tiny")
    engine = EngineConfig(max_model_len=1024, **engine_kw)
    return SimConfig(model="tiny", time_scale=time_scale, lora_adapters=loras, engine=engine,
                     tokenizer=tokenizer)


@pytest.fixture
async def pod() -> AsyncIterator[SimPod]:
    async with SimPod(tiny_config()) as p:
        yield p


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def shape(v: Any) -> Any:
    """Keys (in order) and value kinds, recursively: what must match the real server."""
    if isinstance(v, dict):
        return [(k, shape(x)) for k, x in v.items()]
    if isinstance(v, list):
        return [shape(x) for x in v[:1]]
    if isinstance(v, bool) or v is None:
        return type(v).__name__
    if isinstance(v, (int, float)):
        return "number"
    return type(v).__name__


def sse_events(body: str) -> list[Any]:
    assert body.endswith("data: [DONE]\n\n")
    chunks = body.split("\n\n")
    assert chunks[-1] == ""
    out: list[Any] = []
    for c in chunks[:-1]:
        assert c.startswith("data: ")
        payload = c[6:]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def headers_of(path: Path) -> dict[str, str]:
    lines = path.read_text().replace("\r", "").splitlines()[1:]
    return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}


def error_cases(fixtures: Path) -> dict[str, tuple[int, dict[str, Any]]]:
    """errors.md case id -> (status, body)."""
    text = (fixtures / "errors.md").read_text()
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    for section in text.split("\n## ")[1:]:
        case = section.split()[0]
        status = int(re.search(r"Status: \*\*(\d+)", section).group(1))  # type: ignore[union-attr]
        body = re.search(r"Response body \(raw\):\s*```json\n(.*?)\n```", section, re.S)
        out[case] = (status, json.loads(body.group(1)))  # type: ignore[union-attr]
    return out


# ---------------------------------------------------------------- successful responses

async def test_completion_matches_capture(pod: SimPod, http: aiohttp.ClientSession,
                                          vllm_fixtures: Path) -> None:
    real = json.loads((vllm_fixtures / "completion.json").read_text())
    body = {"model": "tiny", "prompt": "the quick brown fox jumps over the lazy dog",
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with http.post(pod.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["content-type"] == headers_of(vllm_fixtures / "completion.headers.txt")["content-type"]
        assert r.headers["server"] == "uvicorn"
        got = await r.json()
    assert shape(got) == shape(real)
    assert got["id"].startswith("cmpl-") and got["model"] == "tiny"
    assert got["choices"][0]["finish_reason"] == "length"
    usage = got["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert usage["prompt_tokens"] == real["usage"]["prompt_tokens"] == 9  # the tiny model's tokenizer
    text = got["choices"][0]["text"]
    assert re.fullmatch(r"( w\d+){8}", text)  # like the capture's " w1282 w30 ..."
    assert len(load_tokenizer("tiny").encode(text)) == 8


async def test_chat_matches_capture(pod: SimPod, http: aiohttp.ClientSession,
                                    vllm_fixtures: Path) -> None:
    real = json.loads((vllm_fixtures / "chat.json").read_text())
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello the quick brown fox"}],
            "max_tokens": 8, "temperature": 0}
    async with http.post(pod.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        got = await r.json()
    assert shape(got) == shape(real)
    assert got["id"].startswith("chatcmpl-") and got["object"] == "chat.completion"
    assert got["choices"][0]["message"]["role"] == "assistant"
    assert got["choices"][0]["finish_reason"] in ("length", "stop")
    assert got["usage"]["completion_tokens"] <= 8


async def test_completion_stream_matches_capture(pod: SimPod, http: aiohttp.ClientSession,
                                                 vllm_fixtures: Path) -> None:
    real = sse_events((vllm_fixtures / "completion-stream.txt").read_text())
    body = {"model": "tiny", "prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": 8,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(pod.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        want = headers_of(vllm_fixtures / "completion-stream.headers.txt")
        assert r.headers["content-type"] == want["content-type"]
        assert r.headers["transfer-encoding"] == want["transfer-encoding"]
        got = sse_events(await r.text())
    assert len(got) == len(real) == 10
    assert [shape(e) for e in got] == [shape(e) for e in real]
    assert [e["choices"][0]["finish_reason"] for e in got[:8]] == [None] * 7 + ["length"]
    assert got[8]["choices"] == [] and got[8]["usage"]["completion_tokens"] == 8
    assert len({e["id"] for e in got[:9]}) == 1


async def test_chat_stream_matches_capture(pod: SimPod, http: aiohttp.ClientSession,
                                           vllm_fixtures: Path) -> None:
    real = sse_events((vllm_fixtures / "chat-stream.txt").read_text())
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello the quick brown fox"}],
            "max_tokens": 8, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(pod.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        got = sse_events(await r.text())
    assert len(got) == len(real)
    assert [shape(e) for e in got] == [shape(e) for e in real]
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert got[-3]["choices"][0]["finish_reason"] == "length"
    assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 8


async def test_stream_without_usage_has_no_usage_chunk(pod: SimPod, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "hello there", "max_tokens": 3, "ignore_eos": True, "stream": True}
    async with http.post(pod.url + "/v1/completions", json=body) as r:
        got = sse_events(await r.text())
    assert len(got) == 4 and all("usage" not in e for e in got[:-1])


async def test_models_matches_capture(http: aiohttp.ClientSession, vllm_fixtures: Path) -> None:
    real = json.loads((vllm_fixtures / "models.json").read_text())
    async with SimPod(tiny_config(loras=("sql-lora",), max_loras=2)) as p:
        async with http.get(p.url + "/v1/models") as r:
            assert r.status == 200
            assert r.headers["content-type"] == "application/json"
            got = await r.json()
    assert shape(got["data"][0]) == shape(real["data"][0])
    assert got["data"][0]["id"] == "tiny" and got["data"][0]["max_model_len"] == 1024
    assert got["data"][1]["id"] == "sql-lora" and got["data"][1]["parent"] == "tiny"
    assert list(got["data"][1]) == list(real["data"][0])


async def test_request_id_header_is_echoed(pod: SimPod, http: aiohttp.ClientSession) -> None:
    async with http.post(pod.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                         headers={"x-request-id": "trace-42"}) as r:
        assert r.headers["x-request-id"] == "trace-42"
        assert (await r.json())["id"] == "cmpl-trace-42"
    async with http.post(pod.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
        assert "x-request-id" not in r.headers


async def test_health_and_unknown_paths(pod: SimPod, http: aiohttp.ClientSession) -> None:
    async with http.get(pod.url + "/health") as r:
        assert r.status == 200 and await r.read() == b""
    async with http.get(pod.url + "/v2/nothing") as r:
        assert r.status == 404 and await r.json() == {"detail": "Not Found"}
    async with http.get(pod.url + "/v1/completions") as r:
        assert r.status == 405


# ---------------------------------------------------------------- errors

def _body(case: str) -> tuple[str, bytes]:
    c, ch = "/v1/completions", "/v1/chat/completions"

    def j(path: str, obj: Any) -> tuple[str, bytes]:
        return path, json.dumps(obj).encode()

    return {
        "a1": (c, b'{"model":"tiny","prompt":"hello",'),
        "a2": (ch, b'{"model": "tiny", "messages": [}'),
        "b1": j(c, {"model": "no-such-model", "prompt": "hello", "max_tokens": 4}),
        "b2": j(ch, {"model": "no-such-model", "messages": [{"role": "user", "content": "hello"}],
                     "max_tokens": 4}),
        "c1": j(c, {"prompt": "hello", "max_tokens": 4}),
        "c2": j(ch, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}),
        "d1": j(c, {"model": "tiny", "prompt": LONG, "max_tokens": 4}),
        "d2": j(ch, {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4}),
        "d4": j(c, {"model": "tiny", "prompt": LONG, "max_tokens": 4, "stream": True}),
        "d5": j(c, {"model": "tiny", "prompt": SHORT, "max_tokens": 4}),
        "d6": j(c, {"model": "tiny", "prompt": IDS, "max_tokens": 4}),
        "d7": j(ch, {"model": "tiny", "messages": [{"role": "user", "content": SHORT}], "max_tokens": 4}),
        "e1": j(c, {"model": "tiny", "prompt": "hello", "max_tokens": "four"}),
        "e2": (c, b"[1,2,3]"),
        "f1": j(c, {"model": "tiny", "prompt": "hello", "max_tokens": 4, "priority": 5}),
        "g2": j(ch, {"model": "tiny", "messages": [{"role": "user", "content": "hello the quick brown fox"}],
                     "max_tokens": 8, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}),
        "p2": j(c, {"model": "tiny", "prompt": "hello", "max_tokens": 4, "priority": -3}),
        "p3": j(c, {"model": "tiny", "prompt": "hello", "max_tokens": 4, "priority": "high"}),
    }[case]


# Cases whose message depends only on the request, so it must be identical to real vLLM's.
EXACT = {"a1", "a2", "b1", "b2", "d1", "d4", "d5", "d6", "d7", "e1", "e2", "g2", "p3"}


@pytest.mark.parametrize("case", ["a1", "a2", "b1", "b2", "c1", "c2", "d1", "d2", "d4", "d5", "d6",
                                  "d7", "e1", "e2", "f1", "g2", "p2", "p3"])
async def test_error_cases_match_capture(case: str, pod: SimPod, http: aiohttp.ClientSession,
                                         vllm_fixtures: Path) -> None:
    status, real = error_cases(vllm_fixtures)[case]
    path, data = _body(case)
    async with http.post(pod.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
        assert r.status == status
        assert r.headers["content-type"] == "application/json"
        got = await r.json()
    assert shape(got) == shape(real) if status != 200 else got["model"] == "tiny"
    if status == 200:
        return
    for key in ("type", "param", "code"):
        assert got["error"][key] == real["error"][key], key
    if case in EXACT:
        assert got["error"]["message"] == real["error"]["message"]
    else:
        pattern = re.sub(r"\d+", r"\\d+", re.escape(real["error"]["message"]))
        assert re.fullmatch(pattern, got["error"]["message"])


async def test_prompt_plus_max_tokens_over_the_limit_is_shortened(pod: SimPod,
                                                                  http: aiohttp.ClientSession) -> None:
    """Case d3: a 1000-token prompt with max_tokens 100 is accepted and cut to 24 tokens."""
    body = {"model": "tiny", "prompt": " ".join(f"w{i}" for i in range(1000)), "max_tokens": 100,
            "ignore_eos": True}
    async with http.post(pod.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        usage = (await r.json())["usage"]
    assert usage == {"prompt_tokens": 1000, "total_tokens": 1024, "completion_tokens": 24,
                     "prompt_tokens_details": None, "completion_tokens_details": None}


async def test_lora_adapters_are_served_models(http: aiohttp.ClientSession) -> None:
    async with SimPod(tiny_config(loras=("ad1", "ad2"), max_loras=1)) as p:
        body = {"model": "ad2", "prompt": "hello", "max_tokens": 2}
        async with http.post(p.url + "/v1/completions", json=body) as r:
            assert r.status == 200 and (await r.json())["model"] == "ad2"
        async with http.post(p.url + "/v1/completions", json={**body, "model": "ad3"}) as r:
            assert r.status == 404
        async with http.get(p.url + "/metrics") as r:
            text = await r.text()
    assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="ad2",waiting_lora_adapters=""}' in text


# ---------------------------------------------------------------- metrics and load

def metric(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(name)


async def test_metrics_follow_load(http: aiohttp.ClientSession, vllm_fixtures: Path) -> None:
    cfg = tiny_config(time_scale=0.2, max_num_seqs=2)
    async with SimPod(cfg) as p:
        shared = "w0 w1 w2 w3 w4 w5 w6 w7 " * 30
        body = {"model": "tiny", "max_tokens": 60, "ignore_eos": True}
        reqs = [asyncio.create_task(http.post(p.url + "/v1/completions",
                                              json={**body, "prompt": shared + str(i)}))
                for i in range(6)]
        seen_waiting = seen_running = 0.0
        while not all(t.done() for t in reqs):
            async with http.get(p.url + "/metrics") as r:
                assert r.headers["content-type"] == headers_of(
                    vllm_fixtures / "metrics-idle.headers.txt")["content-type"]
                text = await r.text()
            seen_waiting = max(seen_waiting, metric(text, "vllm:num_requests_waiting"))
            seen_running = max(seen_running, metric(text, "vllm:num_requests_running"))
            await asyncio.sleep(0.01)
        for t in reqs:
            resp = t.result()
            assert resp.status == 200
            resp.release()
        async with http.get(p.url + "/metrics") as r:
            text = await r.text()
    assert seen_waiting >= 1 and seen_running == 2
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 6
    assert metric(text, "vllm:generation_tokens_total") == 360
    assert metric(text, "vllm:prefix_cache_hits_total") > 0  # the shared prefix was reused
    assert metric(text, "vllm:time_to_first_token_seconds_count") == 6


async def test_metrics_serve_only_the_series_asked_for_as_vllm_does(http: aiohttp.ClientSession) -> None:
    """vLLM mounts prometheus_client's ASGI app at /metrics, which honours `?name[]=`."""
    async with SimPod(tiny_config()) as p:
        async with http.get(p.url + "/metrics") as r:
            whole = await r.text()
        query = "name%5B%5D=vllm%3Anum_requests_running&name%5B%5D=vllm%3Aprefix_cache_hits_total"
        async with http.get(f"{p.url}/metrics?{query}") as r:
            assert r.status == 200
            part = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(part)}
    assert set(families) == {"vllm:num_requests_running", "vllm:prefix_cache_hits"}
    assert "# TYPE vllm:num_requests_running gauge" in part and "vllm:prefix_cache_hits_created" not in part
    assert len(part) < len(whole) // 10


async def test_client_disconnect_aborts_the_request(http: aiohttp.ClientSession) -> None:
    async with SimPod(tiny_config(time_scale=0.05)) as p:
        body = {"prompt": "hello", "max_tokens": 900, "ignore_eos": True, "stream": True}
        r = await http.post(p.url + "/v1/completions", json=body)
        await r.content.readuntil(b"\n\n")
        r.close()
        for _ in range(500):
            async with http.get(p.url + "/metrics") as m:
                text = await m.text()
            if metric(text, "vllm:request_success_total", finished_reason="abort") == 1:
                break
            await asyncio.sleep(0.01)
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
        assert metric(text, "vllm:num_requests_running") == 0
        assert metric(text, "vllm:kv_cache_usage_perc") == 0
        assert not p.engine.has_unfinished()


async def test_many_concurrent_streams(http: aiohttp.ClientSession) -> None:
    async with SimPod(tiny_config(time_scale=0.01)) as p:
        async def one(i: int) -> int:
            body = {"prompt": f"request {i} " * 20, "max_tokens": 40, "ignore_eos": True, "stream": True}
            async with http.post(p.url + "/v1/completions", json=body) as r:
                events = sse_events(await r.text())
            return sum(1 for e in events[:-1] if e["choices"])

        counts = await asyncio.gather(*(one(i) for i in range(64)))
    assert counts == [40] * 64


# ---------------------------------------------------------------- faults and lifecycle

async def test_metrics_faults(pod: SimPod, http: aiohttp.ClientSession) -> None:
    pod.fault = "garbage"
    async with http.get(pod.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text(errors="replace")
    with pytest.raises(Exception):
        list(text_string_to_metric_families(text))
    pod.fault = "error"
    async with http.get(pod.url + "/metrics") as r:
        assert r.status == 500
    pod.fault = "hang"
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(pod.url + "/metrics", timeout=aiohttp.ClientTimeout(total=0.2)):
            pass
    pod.fault = None
    async with http.get(pod.url + "/metrics") as r:
        assert r.status == 200
    # Inference is unaffected by a metrics fault.
    pod.fault = "hang"
    async with http.post(pod.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
        assert r.status == 200


async def test_start_pods_and_kill_one(http: aiohttp.ClientSession) -> None:
    pods = await start_pods(3, config=tiny_config())
    try:
        assert len({p.port for p in pods}) == 3
        for p in pods:
            async with http.get(p.url + "/health") as r:
                assert r.status == 200
        victim = pods[1]
        body = {"prompt": "long", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        r = await http.post(victim.url + "/v1/completions", json=body)
        await r.content.readuntil(b"\n\n")
        await victim.stop()
        with pytest.raises(aiohttp.ClientError):
            await r.read()  # the stream is cut
        r.close()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(victim.url + "/health"):
                pass
        async with http.get(pods[0].url + "/health") as r2:
            assert r2.status == 200
        # It can come back on the same port, empty like a restarted vLLM.
        port = victim.port
        await victim.start()
        assert victim.port == port
        async with http.get(victim.url + "/metrics") as r3:
            text = await r3.text()
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 0
        assert metric(text, "vllm:num_requests_running") == 0
    finally:
        await stop_pods(pods)


# ---------------------------------------------------------------- tokenization

async def test_prompt_tokens_are_the_tokenizers(http: aiohttp.ClientSession) -> None:
    """The default BPE pod counts like its tokenizer: BOS + text for completions, the chat
    template's text (which has BOS) for chats; token-id prompts as given."""
    tok = load_tokenizer("bpe")
    messages = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "Why?"}]
    async with SimPod(tiny_config(tokenizer="bpe")) as p:
        async with http.post(p.url + "/v1/completions", json={"prompt": "Tell me a story.", "max_tokens": 3}) as r:
            n = (await r.json())["usage"]["prompt_tokens"]
        assert n == len(tok.encode("Tell me a story.")) == len(tok.encode("Tell me a story.", False)) + 1
        async with http.post(p.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 3}) as r:
            got = await r.json()
        assert got["usage"]["prompt_tokens"] == len(tok.encode_chat(messages))
        reply = got["choices"][0]["message"]["content"]
        assert len(tok.encode(reply, add_special_tokens=False)) == got["usage"]["completion_tokens"]
        async with http.post(p.url + "/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 3}) as r:
            assert (await r.json())["usage"]["prompt_tokens"] == 3
        long = "a" * (tok.max_chars_per_token * 1024 + 1)  # over vLLM's character pre-check
        async with http.post(p.url + "/v1/completions", json={"prompt": long, "max_tokens": 3}) as r:
            err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "input_text"
        assert f"more than {tok.max_chars_per_token * 1024} characters" in err["message"]
        words = "ok " * 2000  # fewer characters than the pre-check, more tokens than the context
        async with http.post(p.url + "/v1/completions", json={"prompt": words, "max_tokens": 3}) as r:
            err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "input_tokens" and "at least 1025 input tokens" in err["message"]


async def test_token_ids_outside_the_vocabulary_are_refused(pod: SimPod, http: aiohttp.ClientSession) -> None:
    async with http.post(pod.url + "/v1/completions", json={"prompt": [13, 2047], "max_tokens": 2}) as r:
        assert r.status == 200  # up to the model's vocab_size - 1 (2048 in config.json)
    async with http.post(pod.url + "/v1/completions", json={"prompt": [13, 5000], "max_tokens": 2}) as r:
        assert r.status == 400
        assert (await r.json())["error"] == {"message": "Token id 5000 is out of vocabulary",
                                             "type": "BadRequestError", "param": None, "code": 400}


async def test_cache_salt_is_validated_and_splits_the_prefix_cache(http: aiohttp.ClientSession) -> None:
    async with SimPod(tiny_config(block_size=16)) as p:
        for bad in ("", 5, "a/b", "x" * 129):
            async with http.post(p.url + "/v1/completions",
                                 json={"prompt": "hello", "max_tokens": 2, "cache_salt": bad}) as r:
                assert r.status == 400
                err = (await r.json())["error"]
                assert err["type"] == "BadRequestError" and err["param"] == "cache_salt"
                assert err["message"].startswith("Parameter 'cache_salt' must")
        prompt = " ".join(f"w{i}" for i in range(64))

        async def hits(salt: str | None) -> float:
            body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1}
            if salt is not None:
                body["cache_salt"] = salt
            async with http.post(p.url + "/v1/completions", json=body) as r:
                assert r.status == 200
            async with http.get(p.url + "/metrics") as r:
                return metric(await r.text(), "vllm:prefix_cache_hits_total")

        assert await hits("alice") == 0
        assert await hits("alice") == 48  # 3 of 4 blocks (the last token is always computed)
        assert await hits("bob") == 48  # another salt: nothing shared
        assert await hits(None) == 48
        assert await hits(None) == 96


async def test_chat_without_generation_prompt(pod: SimPod, http: aiohttp.ClientSession) -> None:
    body = {"messages": [{"role": "user", "content": "hello the quick brown fox"}], "max_tokens": 2}
    async with http.post(pod.url + "/v1/chat/completions", json={**body, "add_generation_prompt": False}) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == 7  # no "assistant :" at the end
    async with http.post(pod.url + "/v1/chat/completions", json=body) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == 9
