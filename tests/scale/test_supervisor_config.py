"""What a pod's supervisor refuses before it starts anything, and how it sizes itself."""

from __future__ import annotations

import pytest

from epp.config.options import Options, available_cpus
from epp.params import ConfigError
from epp.scale.supervisor import Supervisor
from tests.precise.test_precise_producer import ISSUE_CONFIG


def test_a_central_kv_event_socket_cannot_be_shared_by_workers() -> None:
    options = Options(config_text=ISSUE_CONFIG, static_endpoints="127.0.0.1:8000")
    with pytest.raises(ConfigError, match="discoverPods"):
        Supervisor(options, 2)


def test_an_invalid_config_fails_before_any_process_starts() -> None:
    with pytest.raises(ConfigError):
        Supervisor(Options(config_text="kind: Nope\n", static_endpoints="127.0.0.1:8000"), 2)


def test_the_default_worker_count_is_the_cpus_this_process_may_use() -> None:
    import os

    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))
