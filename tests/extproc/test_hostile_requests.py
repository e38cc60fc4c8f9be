"""Random hostile traffic through a real gRPC server: every field a client controls given the
wrong type, sign or size, bodies cut short or not UTF-8, oversized and malformed headers, streams
cancelled midway, upstream errors and broken usage — under the built-in default profile, and under
flow control (requests queued, dispatched in turn, cancelled while queued).

What must hold whatever arrives: a bad request gets a 4xx with its reason (never a 5xx: the pool
is healthy), nothing is logged as an error, and once every stream has ended the pods' in-flight
counts, in-flight tokens, the predicted-latency ledger and flow control's queues are back at zero.
(It found a negative `max_tokens` leaving in-flight tokens behind: `epp.api.apis.token_count`.)"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import pytest

from epp.config.defaults import DEFAULT_CONFIG
from tests.conftest import channel_to, running_picker
from tests.flowcontrol.test_protocol import CONFIG as FLOW_CONTROL_CONFIG
from tests.extproc.client import (
    ExtProcClient,
    body_msg,
    headers_msg,
    request_headers,
    response_body_msg,
    response_headers_msg,
)

# The built-in default profile with its metrics source off (the endpoints are fake), and flow
# control with two requests at a time on two pods, so that requests queue, are dispatched in turn
# and are cancelled while queued.
PROFILES = {
    "default": DEFAULT_CONFIG[: DEFAULT_CONFIG.index("dataLayer:")] + "dataLayer:\n  sources: []\n",
    "flow-control": FLOW_CONTROL_CONFIG.replace("maxConcurrency: 1", "maxConcurrency: 2"),
}

PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/generate",
         "/v1/models", "/", "/v1/completions?x=1", "//v1//completions"]
ODD = [None, True, 0, -1, -3, 1.5, 1e308, 2**62, "", "x" * 3000, "\u0000", "\ud7ff\uffff", [], {},
       [1, "a"], {"a": 1}, "NaN", "-5"]
HEADERS = ["x-gateway-inference-fairness-id", "x-gateway-inference-objective", "x-gateway-model-name-rewrite",
           "x-request-id", "x-slo-ttft-ms", "x-slo-tpot-ms", "x-gateway-destination-endpoint",
           "x-gateway-destination-endpoint-served", "x-epp-observe", "x-epp-observe-via", "content-type"]
HEADER_VALUES = ["", "abc", "-1", "0", "1e309", "nan", "inf", "9" * 40, "x" * 9000, "10.0.0.1:8000", "6.6.6.6:80",
                 "\t", "a,b", "50"]
RESPONSES = [
    [b'data: {"choices":[{"text":"a"}]}\n\n',
     b'data: {"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\ndata: [DONE]\n\n'],
    [b'{"usage":{"prompt_tokens":-5,"completion_tokens":1e308}}'],
    [b'{"usage":"x"}'],
    [b"\xff\xfe"],
    [b"data: " + b"{" * 5000],
]


def _text(rng: random.Random) -> str:
    return rng.choice(["hi", "", "x" * rng.randint(0, 20000), "日本語" * 50, "\u202e" * 10])


def _message(rng: random.Random) -> dict[str, object]:
    message: dict[str, object] = {"role": rng.choice(["user", "system", "assistant", "tool", "bogus", 5, None]),
                                  "content": _text(rng)}
    if rng.random() < 0.3:
        message["content"] = rng.choice([[{"type": "text", "text": _text(rng)}], [{"type": rng.choice(ODD)}],
                                         rng.choice(ODD)])
    if rng.random() < 0.1:
        del message["role"]
    return message


def _body(rng: random.Random, path: str) -> bytes:
    body: dict[str, object] = {"model": rng.choice(["m", "m" * 300, "", "a/b", "lora-1", " "])}
    if "chat" in path or rng.random() < 0.2:
        body["messages"] = [_message(rng) for _ in range(rng.randint(0, 5))]
    if "chat" not in path or rng.random() < 0.2:
        body["prompt"] = rng.choice([_text(rng), [_text(rng), _text(rng)], [1, 2, 3], [[1, 2], [3]], [], rng.choice(ODD)])
    for key in ("max_tokens", "max_completion_tokens", "stream", "priority", "n", "cache_salt", "input", "messages",
                "prompt", "model"):
        if rng.random() < 0.15:
            body[key] = rng.choice(ODD)
    if rng.random() < 0.3:
        body["max_tokens"] = rng.choice([1, 16, 100000, 2**31, 0, -3])
    if rng.random() < 0.3:
        body["stream"] = True
    raw = json.dumps(body).encode()
    if rng.random() < 0.05:
        raw = raw[: rng.randint(0, len(raw))]
    if rng.random() < 0.03:
        raw = b"\xff" + raw
    return raw


async def _one(rng: random.Random, channel, statuses: list[int]) -> None:  # type: ignore[no-untyped-def]
    path = rng.choice(PATHS)
    headers = request_headers(path)
    for key in HEADERS:
        if rng.random() < 0.2:
            headers[key] = rng.choice(HEADER_VALUES)
    body = _body(rng, path)
    chunks = [body] if rng.random() < 0.8 else [body[i:i + 700] for i in range(0, max(1, len(body)), 700)]
    cancel = rng.random() < 0.2
    response = rng.choice(RESPONSES)
    status = rng.choice(["200", "500", "429", "abc"])
    client = ExtProcClient(channel)
    try:
        await client.send(headers_msg(headers), *(body_msg(c, eos=i == len(chunks) - 1) for i, c in enumerate(chunks)))
        (first,) = await client.recv(1)
        if first.WhichOneof("response") == "immediate_response":
            statuses.append(first.immediate_response.status.code)
            return
        while not (await client.recv(1))[0].request_body.response.body_mutation.streamed_response.end_of_stream:
            pass  # the picked request's body, streamed back in chunks of the EPP's own size
        if cancel:
            client.cancel()
            return
        await client.send(response_headers_msg({":status": status, "content-type": "text/event-stream"}))
        await client.send(*(response_body_msg(part, eos=i == len(response) - 1) for i, part in enumerate(response)))
        await client.recv(1 + len(response))
    finally:
        await client.close()


def _leftovers(picker) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    """In flight (requests, tokens, ledger entries), open streams, and flow control's queued and
    dispatched requests."""
    endpoints = picker.datastore.endpoints()
    controller = getattr(picker.admission, "controller", None)
    queued = (len(controller), controller.inflight) if controller is not None else (0, 0)
    return (sum(ep.inflight_requests for ep in endpoints), sum(ep.inflight_tokens for ep in endpoints),
            sum(ep.load.requests for ep in endpoints), picker.extproc.active_streams, *queued)


@pytest.mark.parametrize(("profile", "seed"), [("default", 49), ("default", 50), ("flow-control", 51)])
async def test_hostile_traffic_gets_4xx_and_leaves_no_count_behind(profile: str, seed: int,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(seed)
    statuses: list[int] = []
    caplog.set_level(logging.WARNING)
    async with running_picker(config_text=PROFILES[profile], static_endpoints="10.0.0.1:8000,10.0.0.2:8000",
                              metrics_model_names="m") as picker, channel_to(picker) as channel:
        for _ in range(10):
            await asyncio.gather(*(_one(random.Random(rng.random()), channel, statuses) for _ in range(20)))
        nothing = (0,) * 6
        for _ in range(100):  # cancelled streams end on the server's side a moment later
            if _leftovers(picker) == nothing:
                break
            await asyncio.sleep(0.05)
        assert _leftovers(picker) == nothing
    assert statuses and all(400 <= code < 500 for code in statuses), sorted(set(statuses))
    assert len(statuses) < 200  # some of it was routed
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
