"""OpenAI-style request and response bodies: parsing, validation, usage accounting."""

from epp.api.request import CHARS_PER_TOKEN, Api, InferenceRequest, api_for_path, parse_request

__all__ = ["CHARS_PER_TOKEN", "Api", "InferenceRequest", "api_for_path", "parse_request"]
