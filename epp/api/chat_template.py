"""Render chat messages to the prompt text the engine tokenizes, with vLLM's template semantics.

vLLM (0.32, `vllm/renderers/hf.py`) renders chat requests with the model's Jinja chat template as
Hugging Face's `apply_chat_template` does: a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII,
`raise_exception` and `strftime_now` helpers, the tokenizer's special tokens (`bos_token`,
`eos_token`, ...) as variables, and `add_generation_prompt` true by default. Message content given
as a list of parts is joined into one string (text parts, newline-separated: vLLM's "string"
content format) unless the template iterates over the parts itself ("openai" format). A
`developer` message becomes `system` when the template does not mention that role. The rendered
text is then tokenized *without* adding special tokens (the template writes them).

The template comes from `chat_template.jinja` beside the tokenizer, or the `chat_template` entry
of `tokenizer_config.json`. (Our own small renderer: no Transformers dependency.) The EPP's
`token-producer` and the simulator's tokenizers both render with it, so the simulated engines and
the EPP agree on what a chat request's prompt is.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# A template that loops over `message['content']` (or `.content`) wants the parts as a list.
_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+(?:message|msg|m)(?:\[['\"]content['\"]\]|\.content)")


class ChatTemplateError(ValueError):
    """The template is missing or rejected the messages (the request falls back to no tokens)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # tokenizer_config.json may store {"content": "<s>", ...}
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None
        self.special_tokens = dict(special_tokens or {})
        self.openai_content = bool(_ITERATES_CONTENT.search(source))
        self.supports_developer = "developer" in source

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The template of a model folder, or None when it has none."""
        folder = Path(path)
        config: dict[str, Any] = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
        specials = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS if config.get(key)}
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            return cls(template_file.read_text(), specials)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the "default" one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        return cls(source, specials) if isinstance(source, str) and source else None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[Any] | None = None, **kwargs: Any) -> str:
        conversation = [self._message(m) for m in messages]
        try:
            return self._template.render(messages=conversation, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **kwargs)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None

    def _message(self, message: dict[str, Any]) -> dict[str, Any]:
        out = dict(message)
        if out.get("role") == "developer" and not self.supports_developer:
            out["role"] = "system"
        content = out.get("content")
        if isinstance(content, list) and not self.openai_content:
            out["content"] = "\n".join(str(part.get("text", "")) for part in content
                                       if isinstance(part, dict) and part.get("type") in ("text", "input_text"))
        elif content is None:
            out["content"] = ""
        return out


def message_text(content: object) -> str:
    """A message's content in vLLM's "string" format: text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content
                          if isinstance(p, dict) and p.get("type") in ("text", "input_text"))
    return ""


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> ChatTemplate:
    """The compiled template (cached: a server uses one or two templates for its lifetime)."""
    return ChatTemplate(source)


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], bos_token: str = "",
                eos_token: str = "", *, add_generation_prompt: bool = True, **variables: Any) -> str:
    """The prompt text `template` makes of `messages` (to be tokenized without special tokens)."""
    try:
        return compile_template(template).render([dict(m) for m in messages],
                                                 add_generation_prompt=add_generation_prompt,
                                                 bos_token=bos_token, eos_token=eos_token, **variables)
    except ChatTemplateError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from None
