"""A Python endpoint picker for LLM inference (Gateway API Inference Extension compatible)."""

__version__ = "0.1.0"
