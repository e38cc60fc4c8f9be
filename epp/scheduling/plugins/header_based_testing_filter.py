"""`header-based-testing-filter` (conformance only): keep the endpoints the test names in a header.

Header `test-epp-endpoint-selection` holds a comma-separated list of `IP` or `IP:port` (IPv6 may be
bracketed). `IP:port` needs an exact match; a bare `IP` selects an endpoint with that IP (the last
one listed, as the reference's map does). Order follows the header and endpoints are de-duplicated
by IP. A missing or empty header leaves nothing, so the profile fails (429), as in the reference.
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState, Filter

HEADER = "test-epp-endpoint-selection"


def _header(headers: dict[str, str], name: str) -> str:
    value = headers.get(name)
    if value is not None:
        return value
    for key, val in headers.items():  # tolerate non-lowercased keys (test-only path)
        if key.lower() == name:
            return val
    return ""


def _split_item(item: str) -> tuple[str, str]:
    """(host, port) of `ip`, `ip:port`, `[v6]` or `[v6]:port`; port is "" when absent."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if item.count(":") == 1:
        host, _, port = item.partition(":")
        return host, port
    return item, ""  # IPv4 or bare IPv6


class HeaderBasedTestingFilter(Filter):
    type = "header-based-testing-filter"

    def filter(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        raw = _header(request.headers, HEADER)
        if not raw.strip():
            return []
        by_ip: dict[str, Endpoint] = {}
        by_host_port: dict[tuple[str, str], Endpoint] = {}
        for ep in endpoints:
            ip = ep.spec.ip.strip("[]")
            by_ip[ip] = ep
            by_host_port[(ip, str(ep.spec.port))] = ep
        chosen: list[Endpoint] = []
        seen: set[str] = set()
        for part in raw.split(","):
            item = part.strip()
            if not item:
                continue
            host, port = _split_item(item)
            found = by_host_port.get((host, port)) if port else by_ip.get(host)
            if found is not None and found.spec.ip not in seen:
                seen.add(found.spec.ip)
                chosen.append(found)
        return chosen
