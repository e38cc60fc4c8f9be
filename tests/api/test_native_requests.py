"""TGI's and SGLang's native request bodies (samples from their documentation) into InferenceRequest."""

from __future__ import annotations

import orjson
import pytest

from epp.api.apis import MAX_OUTPUT_TOKENS, Api, api_for_path
from epp.api.engines import SGLANG, TGI, accepts_vllm_priority
from epp.api.request import parse_request
from epp.errors import Code, EppError

from .helpers import SGLANG as SGLANG_DIR
from .helpers import TGI_API, sample


def parse(path: str, raw: bytes, **headers: str):  # type: ignore[no-untyped-def]
    return parse_request(raw, path=path, request_id="r1", headers=headers)


def test_the_path_chooses_the_native_apis_and_generate_is_shared() -> None:
    assert api_for_path("/generate_stream") is Api.TGI_GENERATE_STREAM
    assert api_for_path("/generate") is Api.GENERATE
    assert api_for_path("/generate?x=1") is Api.GENERATE
    assert api_for_path("/v1/chat/completions") is Api.CHAT_COMPLETIONS
    assert Api.GENERATE.engines == {TGI, SGLANG}
    assert Api.TGI_GENERATE.engines == {TGI} and Api.SGLANG_GENERATE.engines == {SGLANG}
    assert Api.CHAT_COMPLETIONS.engines is None  # every engine speaks the OpenAI APIs


def test_tgi_generate_from_the_docs() -> None:
    r = parse("/generate", sample(TGI_API, "generate-request.json"))
    assert r.api is Api.TGI_GENERATE
    assert r.model == r.target_model == "tgi"  # no model field: TGI's name for its base model
    assert r.prompt == b"What is Deep Learning?"
    assert r.max_tokens == 20 and r.stream is False
    assert r.body == orjson.loads(sample(TGI_API, "generate-request.json"))


def test_tgi_generate_with_every_documented_parameter() -> None:
    r = parse("/generate", sample(TGI_API, "generate-request-full.json"))
    assert (r.api, r.model, r.max_tokens, r.stream) == (Api.TGI_GENERATE, "tgi", 20, False)
    assert r.prompt == b"My name is Olivier and I"


def test_tgi_streams_by_path_not_by_body() -> None:
    body = orjson.loads(sample(TGI_API, "generate-request.json"))
    assert parse("/generate_stream", orjson.dumps(body)).stream is True
    # TGI's /generate ignores a `stream` field (only its `/` route reads one).
    assert parse("/generate", orjson.dumps({**body, "stream": True})).stream is False


def test_tgi_adapter_is_the_model_and_a_rewrite_cannot_apply() -> None:
    r = parse("/generate", sample(TGI_API, "generate-request-adapter.json"),
              **{"x-gateway-model-name-rewrite": "other"})
    assert r.model == r.target_model == "predibase/customer_support"
    assert not r.model_rewritten  # a native body has no `model` field to rewrite


def test_tgi_messages_api_is_the_openai_parser_with_tgis_model_convention() -> None:
    r = parse("/v1/chat/completions", sample(TGI_API, "chat-request.json"))
    assert (r.api, r.model, r.max_tokens, r.stream) == (Api.CHAT_COMPLETIONS, "tgi", 20, True)
    # TGI accepts a chat request without `model`; the EPP, like the reference, needs one.
    with pytest.raises(EppError, match="model not found in request body") as e:
        parse("/v1/chat/completions", sample(TGI_API, "chat-request-no-model.json"))
    assert e.value.code is Code.BAD_REQUEST


def test_sglang_generate_from_the_docs() -> None:
    r = parse("/generate", sample(SGLANG_DIR, "generate-request.json"))
    assert (r.api, r.model, r.max_tokens, r.stream) == (Api.SGLANG_GENERATE, "sglang", 32, False)
    assert r.prompt == b"The capital of France is"
    assert parse("/generate", sample(SGLANG_DIR, "generate-request-stream.json")).stream is True


def test_sglang_batch_accounts_every_prompt() -> None:
    r = parse("/generate", sample(SGLANG_DIR, "generate-request-batch.json"))
    assert r.max_tokens == 2 * 16
    assert r.prompt == b"Today is a sunny day and I like The capital of France is"


def test_sglang_token_ids_and_lora() -> None:
    r = parse("/generate", sample(SGLANG_DIR, "generate-request-ids.json"))
    assert (r.model, r.max_tokens) == ("lora0", 32)
    assert r.prompt == b"[785,6722,315,9625,374]"


def test_the_same_prompt_hashes_the_same_whatever_the_api() -> None:
    tgi = parse("/generate", orjson.dumps({"inputs": "shared system prompt, then a question"}))
    sglang = parse("/generate", orjson.dumps({"text": "shared system prompt, then a question"}))
    completions = parse("/v1/completions", orjson.dumps({"model": "m", "prompt": "shared system prompt, then a question"}))
    assert tgi.prompt == sglang.prompt == completions.prompt


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/generate", b"{}", "invalid generate request: must have inputs (TGI) or text, input_ids or input_embeds (SGLang)"),
    ("/generate", b'{"model": "m", "prompt": "hi"}', "must have inputs (TGI) or text"),
    ("/generate", b'{"inputs": "a", "text": "b"}', "inputs (TGI) and text/input_ids/input_embeds (SGLang) cannot be combined"),
    ("/generate", b'{"inputs": ""}', "invalid TGI generate request: must have a non-empty string inputs field"),
    ("/generate", b'{"inputs": 7}', "must have a non-empty string inputs field"),
    ("/generate", b'{"inputs": null}', "must have a non-empty string inputs field"),
    ("/generate", b'{"inputs": "x", "parameters": [1]}', "invalid TGI generate request: parameters must be an object"),
    ("/generate", b'{"inputs": "x", "parameters": {"stop": "end"}}', "parameters.stop must be a list of strings"),
    ("/generate_stream", b'{"text": "x"}', "invalid TGI generate request: must have a non-empty string inputs field"),
    ("/generate_stream", b"[]", "error unmarshaling request body: not a JSON object"),
    ("/generate", b'{"inputs": "x"', "error unmarshaling request body"),
    ("/generate", b'{"text": ""}', "invalid SGLang generate request: text must be a non-empty string or list of strings"),
    ("/generate", b'{"text": ["a", 2]}', "text must be a non-empty string or list of strings"),
    ("/generate", b'{"input_ids": []}', "input_ids must be a non-empty list of token ids"),
    ("/generate", b'{"text": "a", "input_ids": [1]}', "give only one of text, input_ids"),
    ("/generate", b'{"text": "a", "sampling_params": 5}', "sampling_params must be an object or a list of objects"),
])
def test_bad_native_bodies_get_a_clear_400(path: str, body: bytes, message: str) -> None:
    with pytest.raises(EppError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        parse(path, body)
    assert e.value.code is Code.BAD_REQUEST and e.value.http_status == 400


def test_wrong_typed_token_limits_are_left_to_the_engine() -> None:
    # The engine rejects them with its own error; the EPP only needs a count it can account.
    assert parse("/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": "5"}}').max_tokens is None
    assert parse("/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": -1}}').max_tokens is None
    assert parse("/generate", b'{"text": "x", "sampling_params": {"max_new_tokens": true}}').max_tokens is None


def test_token_limits_are_bounded_before_they_are_accounted() -> None:
    """A negative limit counted made the pod's in-flight tokens drift up at each such request's
    end, and an enormous one would fill its KV forecast: both are the engine's to reject."""
    completions = "/v1/completions"
    assert parse(completions, b'{"model": "m", "prompt": "x", "max_tokens": -3}').max_tokens is None
    assert parse(completions, b'{"model": "m", "prompt": "x", "max_tokens": 1.5}').max_tokens is None
    big = b'{"model": "m", "prompt": "x", "max_tokens": 9223372036854775807}'
    assert parse(completions, big).max_tokens == MAX_OUTPUT_TOKENS
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1, "max_tokens": 7}'
    assert parse("/v1/chat/completions", chat).max_tokens == 7  # the first limit it can account
    batch = orjson.dumps({"text": ["a", "b"], "sampling_params": {"max_new_tokens": MAX_OUTPUT_TOKENS}})
    assert parse("/generate", batch).max_tokens == MAX_OUTPUT_TOKENS
    huge = b'{"inputs": "x", "parameters": {"max_new_tokens": 99999999999999}}'
    assert parse("/generate", huge).max_tokens == MAX_OUTPUT_TOKENS


def test_only_vllm_takes_flow_controls_priority_field() -> None:
    assert accepts_vllm_priority("vllm")
    assert not accepts_vllm_priority("tgi")  # TGI has no priority field at all
    assert not accepts_vllm_priority("sglang")  # opposite order by default; may abort when off
    assert not accepts_vllm_priority("trtllm-serve")
