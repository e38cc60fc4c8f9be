"""`token-producer`: the prompt's token ids, as the engine will compute them, before admission.

A `RequestPreparer`: request control runs it once per request before admission, bounded by
`timeout`, and it leaves a `TokenizedPrompt` in `request.state` for the scheduling plugins
(`precise-prefix-cache-producer` turns it into router keys). Two backends, llm-d's names:

- `local: {path: DIR}`: the `tokenizers` library in-process, from `DIR/tokenizer.json`; chat
  requests are rendered with the folder's chat template (`chat_template.jinja` or
  `tokenizer_config.json`, vLLM's semantics, `epp.api.chat_template`). An exact prefix cache
  (`epp.api.token_cache`) re-tokenizes only what follows a cached prefix. A prompt whose new text
  is longer than `offloadChars` is tokenized on a worker thread, off the event loop.
- `vllm: {url: URL}`: the model server's own `POST /tokenize` (vLLM 0.32: `{"prompt"}` or
  `{"messages"}` in, `{"tokens": [...]}` out), with `timeout`; `path: /v1/completions/render`
  uses the render endpoints instead (vLLM needs `--enable-scale-out` for those). When it fails or
  times out, the `local` backend answers if configured, else the request has no token ids and the
  precise producer falls back to the approximate index for it.

Completions with one string prompt are tokenized with the tokenizer's special tokens (vLLM's
default `add_special_tokens: true`), chat completions without them (the template writes them); a
prompt given as token ids is used as is. Other APIs are left alone.

| parameter | default | meaning |
|---|---|---|
| `modelName` | "" | the base model: a request for another model name is keyed as that LoRA adapter |
| `local.path` | | folder with `tokenizer.json` (+ chat template) |
| `local.cacheTokens` | 4,000,000 | token ids the prefix cache keeps |
| `local.offloadChars` | 65536 | new text above this is tokenized on a thread (0: never) |
| `vllm.url` / `vllm.path` / `vllm.timeout` | / `/tokenize` / 500ms | the model server's tokenizer |
| `timeout` | 1s | the whole step (the director enforces it) |
| `maxPromptChars` | 4,000,000 | longer prompts are not tokenized (bounded work per request) |

```yaml
- type: token-producer
  parameters: {modelName: tiny, local: {path: /models/tiny}}
```
"""

from __future__ import annotations

import asyncio
import logging
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from tokenizers import Tokenizer

from epp.api.chat_template import ChatTemplate, ChatTemplateError
from epp.api.preparer import TOKENIZED_PROMPT, RequestPreparer, TokenizedPrompt
from epp.api.request import Api, InferenceRequest
from epp.api.token_cache import PrefixTokenCache, Tokenized
from epp.params import ConfigError, Params

if TYPE_CHECKING:
    from epp.plugin import PluginContext

log = logging.getLogger("epp.datalayer.tokens")


@dataclass(slots=True)
class TokenStats:
    local: int = 0
    vllm: int = 0
    vllm_errors: int = 0
    skipped: int = 0  # APIs or prompts not tokenized
    failures: int = 0


class LocalTokenizer:
    """`tokenizers` from a model folder, with the exact prefix cache and the chat template."""

    def __init__(self, path: str | Path, *, cache_tokens: int = 4_000_000, offload_chars: int = 65536) -> None:
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"local.path: no tokenizer.json in {str(folder)!r}")
        self.tokenizer = Tokenizer.from_file(str(file))
        self.template = ChatTemplate.from_dir(folder)
        probe = "a"
        with_special = self.tokenizer.encode(probe, add_special_tokens=True).ids
        bare = self.tokenizer.encode(probe, add_special_tokens=False).ids
        at = _find(with_special, bare)
        self.special_prefix = with_special[:at] if at >= 0 else []
        self.special_suffix = with_special[at + len(bare):] if at >= 0 else []
        self.cache = PrefixTokenCache(self._encode, max_tokens=cache_tokens)
        self.offload_chars = offload_chars
        self._lock = threading.Lock()  # the cache is touched from the loop and from worker threads

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def _tokenize(self, text: str, special: bool) -> Tokenized:
        if self._lock.acquire(blocking=False):
            try:
                result = self.cache.lookup(text)
            finally:
                self._lock.release()
        elif threading.current_thread() is threading.main_thread():
            # A worker thread holds the cache (a long prompt): never block the event loop on it.
            ids, _ = self._encode(text)
            result = Tokenized(array("I", ids), 0, 0)
        else:
            with self._lock:
                result = self.cache.lookup(text)
        if special and (self.special_prefix or self.special_suffix):
            result.ids = array("I", self.special_prefix) + result.ids + array("I", self.special_suffix)
            result.shared_tokens += len(self.special_prefix)
            result.serial = -result.serial  # with and without special tokens are different prompts
            result.prefix_serial = -result.prefix_serial
        return result

    async def tokenize(self, text: str, special: bool) -> Tokenized:
        if self.offload_chars and len(text) > self.offload_chars:
            return await asyncio.to_thread(self._tokenize, text, special)
        return self._tokenize(text, special)

    def render(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
        if self.template is None:
            raise ChatTemplateError("the model folder has no chat template")
        kwargs = body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), dict) else {}
        return self.template.render(messages, add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                                    tools=body.get("tools") if isinstance(body.get("tools"), list) else None,
                                    **kwargs)


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    return -1


class TokenProducer(RequestPreparer):
    type = "token-producer"

    def __init__(self, name: str = "", *, model_name: str = "", local: LocalTokenizer | None = None,
                 vllm_url: str = "", vllm_path: str = "/tokenize", vllm_timeout: float = 0.5,
                 timeout: float = 1.0, max_prompt_chars: int = 4_000_000) -> None:
        super().__init__(name)
        if local is None and not vllm_url:
            raise ValueError("give local: {path: DIR} or vllm: {url: URL}")
        self.model_name = model_name
        self.local = local
        self.vllm_url = vllm_url.rstrip("/")
        self.vllm_path = vllm_path
        self.vllm_timeout = vllm_timeout
        self.timeout = timeout
        self.max_prompt_chars = max_prompt_chars
        self.stats = TokenStats()
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> TokenProducer:
        has_local, has_vllm = params.has("local"), params.has("vllm")
        local_raw = params.mapping("local")
        vllm_raw = params.mapping("vllm")
        local = None
        if has_local:
            lp = Params(local_raw, f"{params.path}.local")
            path = lp.str("path", "")
            if not path:
                raise lp.error("path", "required: a folder with tokenizer.json")
            try:
                local = LocalTokenizer(path, cache_tokens=lp.int("cacheTokens", 4_000_000, min=0),
                                       offload_chars=lp.int("offloadChars", 65536, min=0))
            except (ValueError, OSError) as exc:
                raise ConfigError(f"{params.path}.local.path: cannot load the tokenizer: {exc}") from None
            lp.done()
        url, path, vtimeout = "", "/tokenize", 0.5
        if has_vllm:
            vp = Params(vllm_raw, f"{params.path}.vllm")
            url = vp.str("url", "")
            if not url.startswith(("http://", "https://")):
                raise vp.error("url", f"must be an http(s) URL, got {url!r}")
            path = vp.str("path", "/tokenize", choices=("/tokenize", "/v1/completions/render"))
            vtimeout = vp.duration("timeout", 0.5)
            vp.done()
        if local is None and not url:
            raise ConfigError(f"{params.path}: give local: {{path: DIR}} or vllm: {{url: URL}}")
        producer = cls(name, model_name=params.str("modelName", ""), local=local, vllm_url=url, vllm_path=path,
                       vllm_timeout=vtimeout, timeout=params.duration("timeout", 1.0),
                       max_prompt_chars=params.int("maxPromptChars", 4_000_000, min=1))
        params.done()
        return producer

    # -- the preparation step --

    async def prepare_request(self, request: InferenceRequest) -> None:
        body = request.body
        if body is None:
            return
        kind, payload = self._what(request.api, body)
        if kind is None:
            self.stats.skipped += 1
            return
        lora = request.target_model if self.model_name and request.target_model != self.model_name else ""
        result: Tokenized | None = None
        source = "local"
        if self.vllm_url:
            remote = await self._remote(kind, payload, request)
            if remote is not None:
                result, source = Tokenized(remote, 0, 0), "vllm"
        if result is None and self.local is not None:
            try:
                result = await self._local(kind, payload, body)
                source = "local"
            except ChatTemplateError as exc:
                self.stats.failures += 1
                log.debug("not tokenized", extra={"request_id": request.request_id, "error": str(exc)})
                return
        if result is None:
            return
        if source == "local":
            self.stats.local += 1
        else:
            self.stats.vllm += 1
        request.state[TOKENIZED_PROMPT] = TokenizedPrompt(
            result.ids, lora_name=lora, cache_salt=request.cache_salt, source=source,
            cached_chars=result.reused_chars, serial=result.serial, prefix_serial=result.prefix_serial,
            shared_tokens=result.shared_tokens)

    def _what(self, api: Api, body: dict[str, Any]) -> tuple[str | None, Any]:
        """("text", str) | ("ids", array) | ("chat", messages) | (None, None)."""
        if api is Api.COMPLETIONS:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one prompt
            if isinstance(prompt, str) and len(prompt) <= self.max_prompt_chars:
                return "text", prompt
            if isinstance(prompt, list) and prompt and len(prompt) <= self.max_prompt_chars:
                try:  # token ids: validated in C (uint32), no per-token Python loop
                    return "ids", array("I", prompt)
                except (TypeError, OverflowError):
                    return None, None
            return None, None
        if api is Api.CHAT_COMPLETIONS:
            messages = body.get("messages")
            if isinstance(messages, list) and messages:
                return "chat", messages
        return None, None

    async def _local(self, kind: str, payload: Any, body: dict[str, Any]) -> Tokenized:
        assert self.local is not None
        if kind == "ids":
            return Tokenized(payload, 0, 0)
        if kind == "chat":
            text = self.local.render(payload, body)
            if len(text) > self.max_prompt_chars:
                raise ChatTemplateError("rendered prompt too long")
            return await self.local.tokenize(text, special=False)
        return await self.local.tokenize(payload, special=True)

    async def _remote(self, kind: str, payload: Any, request: InferenceRequest) -> array | None:
        if kind == "ids":
            return payload
        render = self.vllm_path != "/tokenize"
        if kind == "chat":
            path = "/v1/chat/completions/render" if render else "/tokenize"
            body: dict[str, Any] = {"model": request.target_model, "messages": payload}
        else:
            path = "/v1/completions/render" if render else "/tokenize"
            body = {"model": request.target_model, "prompt": payload}
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.post(self.vllm_url + path, data=orjson.dumps(body),
                                          headers={"content-type": "application/json"},
                                          timeout=aiohttp.ClientTimeout(total=self.vllm_timeout)) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                reply = orjson.loads(await resp.read())
            if isinstance(reply, list):  # /v1/completions/render: one entry per prompt
                reply = reply[0] if reply else {}
            tokens = reply.get("tokens") if not render else reply.get("token_ids")
            if not isinstance(tokens, list):
                raise ValueError("no token ids in the reply")
            return array("I", tokens)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OverflowError, TypeError,
                orjson.JSONDecodeError) as exc:
            self.stats.vllm_errors += 1
            log.warning("model-server tokenization failed; falling back",
                        extra={"url": self.vllm_url + path, "error": repr(exc),
                               "fallback": "local" if self.local is not None else "approximate"})
            return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
