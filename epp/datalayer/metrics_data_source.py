"""`metrics-data-source`: where a model server's Prometheus metrics live (reference §3.3, §6.2).

The scraper reads these settings; the plugin itself does no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epp.params import Params
from epp.datalayer.http_client import Target
from epp.datastore import EndpointSpec, join_host_port
from epp.plugin import Plugin

if TYPE_CHECKING:
    from epp.plugin import PluginContext


class MetricsDataSource(Plugin):
    type = "metrics-data-source"

    def __init__(self, name: str = "", *, scheme: str = "http", path: str = "/metrics",
                 insecure_skip_verify: bool = True) -> None:
        super().__init__(name)
        if scheme not in ("http", "https"):
            raise ValueError(f"scheme must be http or https, got {scheme!r}")
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/', got {path!r}")
        self.scheme = scheme
        self.path = path
        self.insecure_skip_verify = insecure_skip_verify

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> MetricsDataSource:
        scheme = params.str("scheme", "http", choices=("http", "https"))
        path = params.str("path", "/metrics")
        if not path.startswith("/"):
            raise params.error("path", f"must start with '/', got {path!r}")
        insecure = params.bool("insecureSkipVerify", True)
        params.done()
        return cls(name, scheme=scheme, path=path, insecure_skip_verify=insecure)

    def url(self, spec: EndpointSpec) -> str:
        """`scheme://ip:port/path`, on the metrics port when discovery set one."""
        return f"{self.scheme}://{join_host_port(spec.ip, spec.metrics_port or spec.port)}{self.path}"

    def target(self, spec: EndpointSpec, query: str = "") -> Target:
        """The same place as `url`, in parts, for the scraper's client (`query`: the series wanted)."""
        return Target(self.scheme, spec.ip, spec.metrics_port or spec.port, self.path, query)
