"""`EnvoyProcess`, the real Envoy the end-to-end tests and `make demo` run."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from epp.local.envoy import EnvoyConfig, EnvoyProcess, free_port

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("taken", ["listen_port", "admin_port"])
def test_a_port_taken_after_it_was_chosen_is_chosen_again(taken: str) -> None:
    """A port chosen free can be taken before Envoy binds it (another process's outgoing
    connection gets it): Envoy starts on another, and its url follows (a clean-clone run of the
    suite failed so once)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {"listen_port": free_port(), "admin_port": free_port(), taken: port}
        envoy = EnvoyProcess(EnvoyConfig(epp_port=free_port(), with_ext_proc=False,
                                         upstreams=("127.0.0.1:9",), **ports))  # type: ignore[arg-type]
        try:
            envoy.start()
            assert getattr(envoy.config, taken) != port
            assert envoy.url == f"http://127.0.0.1:{envoy.config.listen_port}"
            with urllib.request.urlopen(f"http://127.0.0.1:{envoy.config.admin_port}/ready", timeout=5) as r:
                assert r.status == 200
        finally:
            envoy.close()
