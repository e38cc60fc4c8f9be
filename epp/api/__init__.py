"""Request and response bodies: OpenAI, TGI and SGLang native APIs; parsing, validation, usage."""

from epp.api.request import CHARS_PER_TOKEN, Api, InferenceRequest, api_for_path, parse_request

__all__ = ["CHARS_PER_TOKEN", "Api", "InferenceRequest", "api_for_path", "parse_request"]
