"""Request-parser plugin types (`parser: {pluginRef}` in the config).

They carry no behaviour here: the body parsing itself lives in `epp.api`. The loader records which
one is configured so the request path can choose: `openai-parser` (the default) parses OpenAI
bodies; `passthrough-parser` forwards bodies without reading a model or prompt.
"""

from __future__ import annotations

from epp.scheduling.framework import Plugin


class RequestParser(Plugin):
    """Marker base: a plugin the `parser` section may reference."""


class OpenAIParser(RequestParser):
    type = "openai-parser"


class PassthroughParser(RequestParser):
    type = "passthrough-parser"


PARSER_CLASSES: tuple[type[RequestParser], ...] = (OpenAIParser, PassthroughParser)
DEFAULT_PARSER = OpenAIParser.type
