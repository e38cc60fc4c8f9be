"""Where the TGI and SGLang samples live (tests/fixtures/*/README.md names their sources)."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TGI = FIXTURES / "tgi-3.3"
TGI_API = TGI / "api"
SGLANG = FIXTURES / "sglang"


def sample(directory: Path, name: str) -> bytes:
    return (directory / name).read_bytes()
