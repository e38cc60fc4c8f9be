"""`token-producer` through the real request path (build_core → director), local and vLLM backends."""

from __future__ import annotations

import asyncio
import json
import socket
from array import array

import pytest
from tokenizers import Tokenizer

from epp.api.chat_template import ChatTemplate
from epp.api.preparer import TOKENIZED_PROMPT, TokenizedPrompt
from epp.api.request import parse_request
from epp.core import build_core
from epp.datastore import Datastore, EndpointSpec
from epp.params import ConfigError
from tests.precise.helpers import MODEL_DIR, kvreq_prompt


def config(token_params: str, extra: str = "") -> str:
    return f"""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters: {token_params}
- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig: {{zmqEndpoint: "tcp://127.0.0.1:0"}}
{extra}- type: prefix-cache-scorer
  parameters: {{prefixMatchInfoProducerName: precise-prefix-cache-producer}}
dataLayer: {{sources: []}}
"""


LOCAL = f"{{modelName: tiny, local: {{path: '{MODEL_DIR}'}}}}"


def core_for(text: str, n: int = 2):  # type: ignore[no-untyped-def]
    ds = Datastore()
    for i in range(n):
        ds.upsert(EndpointSpec(f"pod-{i}", "127.0.0.1", 8000 + i))
    return build_core(ds, text, tick=0.05)


async def run(core, body: dict, path: str = "/v1/completions"):  # type: ignore[no-untyped-def]
    request = parse_request(json.dumps(body).encode(), path=path, request_id="r1")
    decision, record = await core.director.handle_request(request)
    core.director.release(record)
    return request, decision


def test_chat_template_renders_like_vllm() -> None:
    """Run A of the captures: this chat request was 9 prompt tokens on the real server."""
    template = ChatTemplate.from_dir(MODEL_DIR)
    assert template is not None
    text = template.render([{"role": "user", "content": "hello the quick brown fox"}])
    assert text == "user : hello the quick brown fox\nassistant : "
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    assert len(tok.encode(text, add_special_tokens=False).ids) == 9  # chat.json's usage.prompt_tokens


def test_chat_template_semantics() -> None:
    t = ChatTemplate("{% for m in messages %}{{ m['role'] }}={{ m['content'] }}|{% endfor %}"
                     "{% if add_generation_prompt %}{{ bos_token }}{% endif %}", {"bos_token": "<s>"})
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}, {"type": "text", "text": "b"}]
    assert t.render([{"role": "developer", "content": parts}]) == "system=a\nb|<s>"
    assert t.render([{"role": "user", "content": None}], add_generation_prompt=False) == "user=|"
    openai = ChatTemplate("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }};{% endfor %}{% endfor %}")
    assert openai.render([{"role": "user", "content": parts[:1]}]) == "a;"
    raising = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="no system role"):
        raising.render([])


async def test_local_completion_ids_are_the_engines() -> None:
    core = core_for(config(LOCAL))
    request, _ = await run(core, {"model": "tiny", "prompt": kvreq_prompt(0), "max_tokens": 1})
    tokens = request.state[TOKENIZED_PROMPT]
    assert isinstance(tokens, TokenizedPrompt) and tokens.source == "local"
    assert len(tokens.ids) == 396 and tokens.ids[:3] == array("I", [13, 14, 1125])  # w0 w1 w2, as in seq 0
    assert tokens.lora_name == ""


async def test_local_chat_and_token_id_prompts_and_lora() -> None:
    core = core_for(config(LOCAL))
    request, _ = await run(core, {"model": "tiny", "messages": [{"role": "user", "content": "hello the quick brown fox"}]},
                           path="/v1/chat/completions")
    assert len(request.state[TOKENIZED_PROMPT].ids) == 9
    request, _ = await run(core, {"model": "tiny", "prompt": [5, 6, 7]})
    assert list(request.state[TOKENIZED_PROMPT].ids) == [5, 6, 7]
    request, _ = await run(core, {"model": "my-adapter", "prompt": "w1 w2", "cache_salt": "s"})
    tokens = request.state[TOKENIZED_PROMPT]
    assert tokens.lora_name == "my-adapter" and tokens.cache_salt == "s"
    request, _ = await run(core, {"model": "tiny", "input": "x"}, path="/v1/embeddings")
    assert TOKENIZED_PROMPT not in request.state  # not an API the engine prefix-caches this way


async def test_repeated_long_prefix_uses_the_cache() -> None:
    core = core_for(config(LOCAL))
    prefix = " ".join(f"w{i % 2000}" for i in range(6000))
    for k in range(3):
        request, _ = await run(core, {"model": "tiny", "prompt": prefix + f" w{k} w{k + 1}"})
    assert request.state[TOKENIZED_PROMPT].cached_chars > len(prefix) * 0.9


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def test_vllm_backend_down_falls_back_to_local() -> None:
    params = f"{{modelName: tiny, vllm: {{url: 'http://127.0.0.1:{_closed_port()}', timeout: 200ms}}, local: {{path: '{MODEL_DIR}'}}}}"
    core = core_for(config(params))
    producer = core.config.plugins["token-producer"]
    request, _ = await run(core, {"model": "tiny", "prompt": "w1 w2 w3"})
    assert request.state[TOKENIZED_PROMPT].source == "local"
    assert producer.stats.vllm_errors == 1
    await producer.close()


async def test_vllm_backend_that_hangs_times_out_and_the_request_still_goes() -> None:
    """A server that accepts and never answers: the preparer gives up and the precise producer
    falls back to the approximate index for this request."""
    hung: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    core = core_for(config(f"{{modelName: tiny, vllm: {{url: 'http://127.0.0.1:{port}', timeout: 100ms}}}}"))
    request, decision = await run(core, {"model": "tiny", "prompt": "w1 w2 w3"})
    assert TOKENIZED_PROMPT not in request.state
    match = decision.result.cycle.data["precise-prefix-cache-producer"]
    assert "no token ids" in match.note
    await core.config.plugins["token-producer"].close()
    for w in hung:
        w.close()
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("params, message", [
    ("{}", "give local"),
    ("{local: {path: /nonexistent}}", "cannot load the tokenizer"),
    ("{vllm: {url: 'ftp://x'}}", "must be an http"),
    ("{local: {}}", "required"),
    (f"{{local: {{path: '{MODEL_DIR}', bogus: 1}}}}", "bogus: unknown field"),
])
def test_bad_token_producer_config(params: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        core_for(config(params))


async def test_router_keys_reused_from_the_extended_prompt_equal_fresh_ones() -> None:
    from epp.datastore.kv_block_index import chain_seed, router_keys

    core = core_for(config(LOCAL))
    producer = core.precise_producers[0]
    prompt = " ".join(f"w{i % 2000}" for i in range(3000))
    for turn in range(4):
        prompt += " " + " ".join(f"w{(turn * 31 + j) % 2000}" for j in range(150))
        request, _ = await run(core, {"model": "tiny", "prompt": prompt, "cache_salt": "s" if turn == 3 else ""})
        tokens = request.state[TOKENIZED_PROMPT]
        if turn in (1, 2):
            assert tokens.prefix_serial and tokens.shared_tokens > 2500
        fresh = router_keys(tokens.ids, producer.index.block_size, chain_seed("", tokens.cache_salt))
        assert request.state["precise-prefix-keys"] == fresh


async def test_token_id_prompts_are_validated_in_c() -> None:
    core = core_for(config(LOCAL))
    for prompt, expect in (([5], [5]), ([[7, 8]], [7, 8]), ([1, -1], None), ([1, 2**33], None), ([1, "x"], None)):
        request, _ = await run(core, {"model": "tiny", "prompt": prompt})
        tokens = request.state.get(TOKENIZED_PROMPT)
        assert (list(tokens.ids) if tokens else None) == expect, prompt


async def test_a_busy_cache_never_blocks_the_event_loop() -> None:
    """While a worker thread tokenizes a long prompt, the loop tokenizes without the cache."""
    from epp.datalayer.token_producer import LocalTokenizer

    local = LocalTokenizer(MODEL_DIR, offload_chars=1000)
    with local._lock:  # as if the worker held it
        result = await local.tokenize("w1 w2 w3", special=True)
    assert list(result.ids) == [14, 1125, 1236]
    long_text = " ".join(f"w{i % 2000}" for i in range(3000))
    result = await local.tokenize(long_text, special=True)  # on a thread
    assert len(result.ids) == 3000
