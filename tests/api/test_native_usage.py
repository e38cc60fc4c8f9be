"""Usage read from TGI's and SGLang's responses (samples in tests/fixtures), whole or in odd chunks."""

from __future__ import annotations

import orjson
import pytest

from epp.api.apis import Api
from epp.api.request import parse_request
from epp.api.response import ResponseObserver, Usage, observer_for

from .helpers import SGLANG, TGI_API, sample


def observe(api: Api, body: bytes, *, streaming: bool, chunk: int = 0, headers: dict[str, str] | None = None,
            prompt_estimate: int = 0) -> Usage | None:
    o = ResponseObserver(streaming=streaming, api=api, headers=headers, prompt_estimate=prompt_estimate)
    step = chunk or len(body)
    for i in range(0, len(body), step):
        o.feed(body[i:i + step])
    return o.finish()


CHUNKS = [0, 1, 7, 64]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_tgi_generate_counts_come_from_its_headers(chunk: int) -> None:
    headers = orjson.loads(sample(TGI_API, "generate-response-headers.json"))
    usage = observe(Api.TGI_GENERATE, sample(TGI_API, "generate-response.json"), streaming=False,
                    chunk=chunk, headers=headers, prompt_estimate=99)
    assert usage == Usage(prompt_tokens=6, completion_tokens=20, total_tokens=26)


def test_tgi_generate_details_without_headers() -> None:
    usage = observe(Api.TGI_GENERATE, sample(TGI_API, "generate-response-details.json"), streaming=False)
    assert usage == Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)  # prefill has one token


def test_bad_count_headers_are_not_believed() -> None:
    for value in ("-3", "1e9", "99999999999999999999", "abc", ""):
        usage = observe(Api.TGI_GENERATE, sample(TGI_API, "generate-response.json"), streaming=False,
                        headers={"x-prompt-tokens": value, "x-generated-tokens": value})
        assert usage is None, value


@pytest.mark.parametrize("chunk", CHUNKS)
def test_tgi_stream_without_details_counts_the_last_index(chunk: int) -> None:
    usage = observe(Api.TGI_GENERATE_STREAM, sample(TGI_API, "generate-stream.txt"), streaming=True,
                    chunk=chunk, prompt_estimate=5)
    assert usage == Usage(prompt_tokens=5, completion_tokens=4, total_tokens=9)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_tgi_stream_with_details(chunk: int) -> None:
    usage = observe(Api.TGI_GENERATE_STREAM, sample(TGI_API, "generate-stream-details.txt"), streaming=True,
                    chunk=chunk, prompt_estimate=99)
    assert usage == Usage(prompt_tokens=6, completion_tokens=2, total_tokens=8)


def test_tgi_stream_error_and_unterminated_last_event() -> None:
    assert observe(Api.TGI_GENERATE_STREAM, sample(TGI_API, "generate-stream-error.txt"), streaming=True) is None
    last = sample(TGI_API, "generate-stream-details.txt").rstrip(b"\n")
    assert observe(Api.TGI_GENERATE_STREAM, last, streaming=True) == Usage(6, 2, 8)


def test_a_generated_text_that_looks_like_an_event_is_not_one() -> None:
    body = (b'data:{"index":1,"token":{"id":1,"text":"x","logprob":-1,"special":false},'
            b'"generated_text":"data:{\\"index\\":99,\\"token\\":{}}","details":null}\n\n')
    assert observe(Api.TGI_GENERATE_STREAM, body, streaming=True) == Usage(0, 1, 1)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_tgi_messages_api_usage_is_openais(chunk: int) -> None:
    usage = observe(Api.CHAT_COMPLETIONS, sample(TGI_API, "chat-stream-usage.txt"), streaming=True, chunk=chunk)
    assert usage == Usage(prompt_tokens=21, completion_tokens=2, total_tokens=23)
    usage = observe(Api.CHAT_COMPLETIONS, sample(TGI_API, "chat-response.json"), streaming=False, chunk=chunk)
    assert usage == Usage(prompt_tokens=2943, completion_tokens=84, total_tokens=3027)


def test_sglang_generate_meta_info() -> None:
    usage = observe(Api.SGLANG_GENERATE, sample(SGLANG, "generate-response.json"), streaming=False)
    assert usage == Usage(prompt_tokens=5, completion_tokens=32, total_tokens=37, cached_reported=True)
    batch = observe(Api.SGLANG_GENERATE, sample(SGLANG, "generate-response-batch.json"), streaming=False)
    assert batch == Usage(prompt_tokens=13, completion_tokens=13, total_tokens=26, cached_tokens=4, cached_reported=True)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_sglang_stream_takes_the_last_cumulative_event(chunk: int) -> None:
    usage = observe(Api.SGLANG_GENERATE, sample(SGLANG, "generate-stream.txt"), streaming=True, chunk=chunk)
    assert usage == Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8, cached_tokens=4, cached_reported=True)
    assert observe(Api.SGLANG_GENERATE, sample(SGLANG, "generate-stream-error.txt"), streaming=True) is None


def test_the_observer_follows_the_requests_api() -> None:
    request = parse_request(sample(TGI_API, "generate-request.json"), path="/generate_stream", request_id="r")
    o = observer_for(request, {"content-type": "text/event-stream"}, streaming=True)
    assert o.api is Api.TGI_GENERATE_STREAM
    o.feed(sample(TGI_API, "generate-stream.txt"))
    assert o.finish() == Usage(request.prompt_tokens_estimate, 4, request.prompt_tokens_estimate + 4)
    assert observer_for(None, {}, streaming=False).api is Api.COMPLETIONS
