"""`epp sim --engine tgi`: a simulated pod speaking TGI 3.3, compared with the shapes in
tests/fixtures/tgi-3.3 (sources named in its README) over real HTTP."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.datalayer import CoreMetricsExtractor
from epp.datastore import Endpoint, EndpointSpec
from epp.sim import cli
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.server import SimPod
from epp.sim.tgi_exposition import rust_float

from test_sim_http import shape  # tests/sim is not a package: pytest puts it on the path
from test_sim_metrics import parse as parse_exposition

TGI = Path(__file__).resolve().parents[1] / "fixtures" / "tgi-3.3"
API = TGI / "api"


def tgi_config(**kw: Any) -> SimConfig:
    # max_model_len 4096: the bucket layout of the fixture (max_input_tokens 4095).
    # 4 characters per token: the token counts the tests check are the TGI shapes', not a tokenizer's.
    return SimConfig(model="tiny", time_scale=kw.pop("time_scale", 0.01), server="tgi", tokenizer="chars4",
                     mean_output_tokens=kw.pop("mean_output_tokens", 1e6),
                     engine=EngineConfig(max_model_len=4096, **kw))


def keys(v: Any) -> Any:
    """Keys in order, recursively: for answers whose nullable values differ from the sample's."""
    if isinstance(v, dict):
        return [(k, keys(x)) for k, x in v.items()]
    if isinstance(v, list) and v:
        return [keys(v[0])]
    return None


def fixture(name: str) -> Any:
    return orjson.loads((API / name).read_bytes())


def events(text: str) -> list[Any]:
    """`data:` events of a TGI stream (no space after the colon, a blank line after each)."""
    chunks = text.split("\n\n")
    assert chunks[-1] == "", text
    assert all(c.startswith("data:") and not c.startswith("data: ") for c in chunks[:-1]), text
    return [c[5:] if c == "data:[DONE]" else orjson.loads(c[5:]) for c in chunks[:-1]]


@pytest.fixture
async def pod() -> AsyncIterator[SimPod]:
    async with SimPod(tgi_config()) as p:
        yield p


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def post(http: aiohttp.ClientSession, pod: SimPod, path: str, body: Any) -> tuple[int, dict[str, str], str]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with http.post(pod.url + path, data=data, headers={"content-type": "application/json"}) as r:
        return r.status, dict(r.headers), await r.text()


async def test_generate_answers_in_tgis_shape_with_its_headers(pod: SimPod, http: aiohttp.ClientSession) -> None:
    status, headers, text = await post(http, pod, "/generate", fixture("generate-request.json"))
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    body = orjson.loads(text)
    assert shape(body) == shape(fixture("generate-response.json"))
    expected = fixture("generate-response-headers.json")
    assert {k: headers[k] for k in expected if k.startswith("x-")}.keys() == {k for k in expected if k.startswith("x-")}
    assert headers["x-generated-tokens"] == "20" and headers["x-prompt-tokens"] == "6"
    status, _, text = await post(http, pod, "/generate", {**fixture("generate-request.json"),
                                                          "parameters": {"max_new_tokens": 1, "details": True,
                                                                         "do_sample": True, "seed": 42}})
    body = orjson.loads(text)
    want = fixture("generate-response-details.json")
    want["details"]["prefill"] = []  # prompt logprobs (decoder_input_details) are not simulated
    assert shape(body) == shape(want) and body["details"]["seed"] == 42


async def test_generate_stream_events(pod: SimPod, http: aiohttp.ClientSession) -> None:
    status, headers, text = await post(http, pod, "/generate_stream", fixture("generate-request.json"))
    assert status == 200 and headers["Content-Type"] == "text/event-stream" and headers["X-Accel-Buffering"] == "no"
    got = events(text)
    assert [e["index"] for e in got] == list(range(1, 21))
    want = events((API / "generate-stream.txt").read_text())
    assert shape(got[0]) == shape(want[0]) and shape(got[-1]) == shape(want[-1])
    assert got[-1]["generated_text"] == "".join(e["token"]["text"] for e in got)
    status, _, text = await post(http, pod, "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2,
                                                                                               "details": True}})
    last = events(text)[-1]
    assert shape(last) == shape(events((API / "generate-stream-details.txt").read_text())[-1])
    assert last["details"]["generated_tokens"] == 2 and last["details"]["input_length"] == 1


async def test_messages_api_answers_as_tgi(pod: SimPod, http: aiohttp.ClientSession) -> None:
    status, _, text = await post(http, pod, "/v1/chat/completions", {**fixture("chat-request.json"), "stream": False})
    body = orjson.loads(text)
    assert status == 200 and shape(body) == shape(fixture("chat-response.json"))
    assert body["model"] == "tiny"  # "tgi" means the served model, which the answer names
    status, _, text = await post(http, pod, "/v1/chat/completions",
                                 {**fixture("chat-request.json"), "stream_options": {"include_usage": True}})
    got = events(text)
    want = events((API / "chat-stream-usage.txt").read_text())
    assert got[-1] == "[DONE]" and shape(got[0]) == shape(want[0]) and shape(got[-2]) == shape(want[-2])
    assert got[-2]["usage"]["completion_tokens"] == 20 and got[-2]["choices"] == []
    status, _, _ = await post(http, pod, "/v1/chat/completions", fixture("chat-request-no-model.json"))
    assert status == 200  # TGI needs no model


@pytest.mark.parametrize(("body", "status", "text"), [
    (b'{"inputs": ""}', 422, '{"error":"Input validation error: `inputs` cannot be empty","error_type":"validation"}'),
    (b'{"inputs": "hi", "parameters": {"max_new_tokens": 0}}', 422,
     '{"error":"Input validation error: `max_new_tokens` must be strictly positive","error_type":"validation"}'),
    (b'{"inputs": "hi", "parameters": {"max_new_tokens": 5000}}', 422,
     '{"error":"Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 1 `inputs` '
     'tokens and 5000 `max_new_tokens`","error_type":"validation"}'),
    (b'{"inputs": "hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}', 422,
     '{"error":"Input validation error: `stop` supports up to 4 stop sequences. Given: 5","error_type":"validation"}'),
    (b'{"parameters": {}}', 422,
     "Failed to deserialize the JSON body into the target type: missing field `inputs` at line 1 column 18"),
    (b'{"inputs": 5}', 422,
     "Failed to deserialize the JSON body into the target type: inputs: invalid type: integer `5`, expected a "
     "string at line 1 column 13"),
    (b'{"inputs": "x"', 400, "Failed to parse the request body as JSON"),
])
async def test_bad_bodies_get_tgis_errors(pod: SimPod, http: aiohttp.ClientSession, body: bytes, status: int,
                                          text: str) -> None:
    got_status, headers, got = await post(http, pod, "/generate", body)
    assert got_status == status and got.startswith(text), got
    assert headers["Content-Type"].startswith("application/json" if text.startswith("{") else "text/plain")


async def test_stream_validation_errors_are_events_and_json_needs_its_content_type(
        pod: SimPod, http: aiohttp.ClientSession) -> None:
    status, _, text = await post(http, pod, "/generate_stream", {"inputs": ""})
    assert status == 200 and events(text) == [fixture("error-validation.json")]
    async with http.post(pod.url + "/generate", data=b'{"inputs": "x"}', headers={"content-type": "text/plain"}) as r:
        assert r.status == 415 and await r.text() == "Expected request with `Content-Type: application/json`"
    async with http.get(pod.url + "/nowhere") as r:
        assert r.status == 404 and await r.read() == b""


async def test_beyond_max_concurrent_requests_tgi_is_overloaded(http: aiohttp.ClientSession) -> None:
    async with SimPod(tgi_config(time_scale=1.0)) as pod:
        pod.tgi.limits.max_concurrent_requests = 1
        first = asyncio.create_task(post(http, pod, "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 500}}))
        while pod.tgi.in_flight == 0:
            await asyncio.sleep(0.01)
        status, _, text = await post(http, pod, "/generate", {"inputs": "hi"})
        assert status == 429 and orjson.loads(text) == fixture("error-overloaded.json")
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


async def test_unknown_fields_are_ignored_and_counted(pod: SimPod, http: aiohttp.ClientSession) -> None:
    status, _, _ = await post(http, pod, "/generate", {"inputs": "hi", "priority": 3, "model": "x",
                                                       "parameters": {"max_new_tokens": 1}})
    assert status == 200 and pod.tgi.ignored_fields == {"priority": 1, "model": 1}


async def test_info_health_and_models(pod: SimPod, http: aiohttp.ClientSession) -> None:
    async with http.get(pod.url + "/info") as r:
        info = await r.json()
    assert keys(info) == keys(fixture("info.json"))
    assert (info["model_id"], info["max_total_tokens"], info["max_input_tokens"]) == ("tiny", 4096, 4095)
    async with http.get(pod.url + "/health") as r:
        assert r.status == 200 and await r.read() == b""
    async with http.get(pod.url + "/v1/models") as r:
        assert (await r.json())["data"][0]["id"] == "tiny"


def test_numbers_print_as_rust_does() -> None:
    # Values seen in a real TGI capture (tests/fixtures/tgi-3.3/README.md).
    assert rust_float(0.0001 * 1.5) == "0.00015000000000000001"
    assert rust_float(511 / 100 * 3) == "15.330000000000002"
    assert rust_float(128.0) == "128" and rust_float(0.0) == "0"
    assert rust_float(1e-7) == "0.0000001" and rust_float(float("inf")) == "+Inf"


async def test_metrics_are_tgis_families_and_a_fresh_pod_has_none(pod: SimPod, http: aiohttp.ClientSession) -> None:
    async with http.get(pod.url + "/metrics") as r:
        assert r.headers["Content-Type"] == "text/plain; charset=utf-8" and await r.text() == ""
    long = asyncio.create_task(post(http, pod, "/generate", {"inputs": "long", "parameters": {"max_new_tokens": 1000}}))
    while not pod.engine.running:
        await asyncio.sleep(0.001)
    # These join a running batch: TGI's chunked concatenation (tgi_batch_concat{reason="chunking"}).
    await asyncio.gather(*(post(http, pod, "/generate", {"inputs": f"question {i} " * 20,
                                                         "parameters": {"max_new_tokens": 8}}) for i in range(6)))
    await long
    await post(http, pod, "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 3}})
    await post(http, pod, "/generate", {"inputs": ""})
    async with http.get(pod.url + "/metrics") as r:
        text = await r.text()
    list(text_string_to_metric_families(text))  # valid Prometheus text
    got = parse_exposition(text)
    want = parse_exposition((TGI / "metrics-busy.txt").read_text())
    simulated = set(want) - {"tgi_batch_concat_duration"}  # concat time is not modelled
    assert simulated <= set(got), simulated - set(got)
    for name in simulated:
        assert (got[name].type, got[name].help) == (want[name].type, want[name].help), name
        assert got[name].label_names == want[name].label_names, name
        if got[name].type == "histogram":  # same bucket bounds as TGI computes them
            bounds = [lab["le"] for sample, lab, _ in got[name].samples if sample.endswith("_bucket")]
            assert bounds == [lab["le"] for sample, lab, _ in want[name].samples
                              if sample.endswith("_bucket")][:len(bounds)], name
    assert text.endswith("\n\n") and "\n\n\n" not in text
    count = {s[0]: s[2] for s in got["tgi_request_count"].samples}
    assert count["tgi_request_count"] == 9  # every request that reached a handler
    assert got["tgi_queue_size"].samples[0][2] == 0 and got["tgi_batch_current_size"].samples[0][2] == 0


async def test_the_epps_tgi_mapping_reads_the_simulated_pod(http: aiohttp.ClientSession) -> None:
    async with SimPod(tgi_config(time_scale=0.5, max_num_seqs=2)) as pod:
        tasks = [asyncio.create_task(post(http, pod, "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 200}}))
                 for _ in range(5)]
        ep = Endpoint(EndpointSpec("tgi-0", "127.0.0.1", pod.port, engine="tgi"))
        extractor = CoreMetricsExtractor()
        while True:
            async with http.get(pod.url + "/metrics") as r:
                metrics = extractor.extract(ep, await r.read(), now=1.0).metrics
            if metrics is not None and metrics.running_requests == 2:
                break
            await asyncio.sleep(0.01)
        assert metrics.waiting_queue_size == 3 and metrics.kv_cache_usage == 0.0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_the_cli_switch() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.config_from_args(parser.parse_args(["--engine", "tgi"])).server == "tgi"
    assert cli.config_from_args(parser.parse_args([])).server == "vllm"
    with pytest.raises(ValueError, match="unknown server"):
        SimConfig(server="llamacpp").validate()  # type: ignore[arg-type]


async def test_completions_api_answers_as_tgi(pod: SimPod, http: aiohttp.ClientSession) -> None:
    status, headers, text = await post(http, pod, "/v1/completions", {"model": "tgi", "prompt": "What is", "max_tokens": 3})
    body = orjson.loads(text)
    assert status == 200 and list(body) == ["object", "id", "created", "model", "system_fingerprint", "choices", "usage"]
    assert body["usage"]["completion_tokens"] == 3 and headers["x-generated-tokens"] == "3"
    status, _, text = await post(http, pod, "/v1/completions", {"prompt": ["What is"], "max_tokens": 2, "stream": True})
    got = events(text)
    assert got[-1] == "[DONE]" and got[0]["choices"][0]["finish_reason"] == "" and "usage" not in got[0]
    assert got[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    status, _, text = await post(http, pod, "/v1/completions", {"prompt": "x", "suffix": "y"})
    assert status == 422 and orjson.loads(text)["error_type"] == "suffix not supported"
