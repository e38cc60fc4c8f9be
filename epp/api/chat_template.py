"""Chat messages → the prompt text a vLLM server tokenizes, rendered the way vLLM renders it.

vLLM (0.32, `vllm/renderers/hf.py` and `chat_utils.py`) turns a chat request into one string with
the model's Jinja chat template through transformers' `apply_chat_template`, and tokenizes that
string *without* adding special tokens (`add_special_tokens` defaults to False for chat: the
template writes BOS itself; completions default to True). To predict the engine's tokens, a
router or a simulator must render the same string, so this module follows the same rules:

- a sandboxed, immutable Jinja environment with `trim_blocks` and `lstrip_blocks` and the
  `loopcontrols` extension; `raise_exception(msg)` and `strftime_now(fmt)` as globals; a `tojson`
  filter that keeps non-ASCII characters;
- the variables `messages`, `add_generation_prompt` (True: the prompt ends where the assistant's
  reply begins), `bos_token`, `eos_token`, plus any the caller adds (`tools`, ...);
- message content in vLLM's "string" format, which plain-text templates get: a list of content
  parts becomes its text parts joined by newlines, a missing content the empty string.

Templates that iterate over content parts ("openai" content format) and multimodal parts are not
modelled. A template that raises (`raise_exception`) or fails gives `ChatTemplateError`, which
vLLM answers with 400 and the template's own message.

No simulator or EPP state here: the module is shared by `epp.sim` and the EPP's token producer.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox


class ChatTemplateError(ValueError):
    """The template did not compile, or it rejected these messages."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached: a server uses one or two templates for its lifetime)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from None


def message_text(content: object) -> str:
    """A message's content in vLLM's "string" format."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content
                         if isinstance(p, dict) and p.get("type") == "text")
    return ""


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template sees them: every field kept, `content` as a string."""
    return [{**m, "content": message_text(m.get("content"))} for m in messages]


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], bos_token: str = "",
                eos_token: str = "", *, add_generation_prompt: bool = True,
                **variables: Any) -> str:
    """The prompt text `template` makes of `messages` (to be tokenized without special tokens)."""
    compiled = compile_template(template)
    try:
        return compiled.render(messages=normalize_messages(messages),
                               add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                               eos_token=eos_token, **variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
