"""Envoy + the EPP + simulated vLLM pods on localhost, in one async context.

The EPP and the pods run in this process's event loop; Envoy is a child process. Used by the
end-to-end tests, the demo and the live benchmarks, so all three exercise the same wiring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.config.options import Options
from epp.discovery.static import StaticDiscovery
from epp.local.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.runner import EndpointPicker
from epp.sim.config import SimConfig
from epp.sim.server import SimPod, start_pods, stop_pods


@dataclass(slots=True)
class StackConfig:
    pods: int = 3
    sim: SimConfig = field(default_factory=SimConfig)
    epp_config_text: str = ""  # EndpointPickerConfig YAML; "" is the built-in default
    secure_serving: bool = True
    with_epp: bool = True  # False: Envoy alone (no ext_proc), for baselines
    request_body_mode: str = "FULL_DUPLEX_STREAMED"
    response_body_mode: str = "NONE"  # the shipped config: an observer filter reports the response
    refresh_metrics_interval: float = 0.05
    debug_decision_header: bool = False


class LocalStack:
    def __init__(self, config: StackConfig | None = None) -> None:
        self.config = config or StackConfig()
        self.pods: list[SimPod] = []
        self.picker: EndpointPicker | None = None
        self.envoy: EnvoyProcess | None = None
        self.discovery = StaticDiscovery([])

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    async def start(self) -> None:
        c = self.config
        try:
            self.pods = await start_pods(c.pods, config=c.sim)
            epp_port = 0
            if c.with_epp:
                from epp.discovery.static import parse_endpoint_list

                self.discovery = StaticDiscovery(
                    parse_endpoint_list(",".join(f"{p.address}" for p in self.pods)))
                options = Options(grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=0, bind_address="127.0.0.1",
                                  secure_serving=c.secure_serving, config_text=c.epp_config_text,
                                  refresh_metrics_interval=c.refresh_metrics_interval, pool_name="local",
                                  debug_decision_header=c.debug_decision_header)
                self.picker = EndpointPicker(options, discovery=self.discovery)
                await self.picker.start()
                epp_port = self.picker.grpc_port
            self.envoy = EnvoyProcess(EnvoyConfig(
                listen_port=free_port(), admin_port=free_port(), epp_port=epp_port or free_port(),
                epp_tls=c.secure_serving, with_ext_proc=c.with_epp, upstreams=tuple(p.address for p in self.pods),
                request_body_mode=c.request_body_mode, response_body_mode=c.response_body_mode,
                # the decision header rides on the response headers, which then go through the EPP
                response_header_mode="SEND" if c.debug_decision_header else "",
            ))
            self.envoy.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self.envoy:
            self.envoy.close()
            self.envoy = None
        if self.picker:
            await self.picker.stop(grace=0)
            self.picker = None
        await stop_pods(self.pods)

    async def __aenter__(self) -> LocalStack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
