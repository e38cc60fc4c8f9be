from __future__ import annotations

import pytest

from .helpers import FIXTURE_NAMES, fixture_body


@pytest.fixture(params=FIXTURE_NAMES)
def vllm_fixture(request: pytest.FixtureRequest) -> tuple[str, bytes]:
    return request.param, fixture_body(request.param)
