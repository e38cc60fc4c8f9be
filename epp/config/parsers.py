"""Request-parser plugin types (`parser: {pluginRef}` in the config).

They carry no behaviour here: the body parsing itself lives in `epp.api`, which reads OpenAI
bodies (completions, chat, responses, conversations, embeddings). `openai-parser` (the default)
is the one parser; the loader records it so the effective configuration shows it.

The reference's `passthrough-parser` (no parsing: the body is forwarded as raw bytes, no model is
read, prefix scoring is off, requests are placed on load alone) is rejected with a message rather
than accepted and ignored: this EPP's request path always parses, so accepting it would run a
different EPP than the one configured.
"""

from __future__ import annotations

from epp.scheduling.framework import Plugin


class RequestParser(Plugin):
    """Marker base: a plugin the `parser` section may reference."""


class OpenAIParser(RequestParser):
    type = "openai-parser"


PARSER_CLASSES: tuple[type[RequestParser], ...] = (OpenAIParser,)
DEFAULT_PARSER = OpenAIParser.type

# Reference parser types this EPP does not implement, with what to do instead.
UNSUPPORTED_PARSERS: dict[str, str] = {
    "passthrough-parser": (
        "passthrough-parser is not supported: this EPP parses every request body as OpenAI JSON "
        "(openai-parser) to read the model and prompt it schedules on, and cannot forward bodies "
        "unparsed; remove it (and the `parser` section) to use openai-parser"),
}
