"""Many fake vLLM `/metrics` endpoints whose numbers move on every scrape, in one child process.

`bench/stubpods.py` serves a fixed page from Envoy: cheap, but a scraper that skips unchanged
pages (as this EPP's does) would be measured on its best case. Here every answer is the simulated
vLLM page (~55 KB, vLLM 0.32's families) with its gauges and counters changed, the way a busy
pod's are: queue, running, KV use, the token and ITL counters (monotonic), the process's CPU
seconds. One uvloop process answers all ports with a minimal keep-alive HTTP/1.1 responder; its
own CPU is not the EPP's, which is what the benchmarks measure.

    with MovingPages(100) as pages: pages.addresses  # ["127.0.0.1:port", ...]
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from bench.common import free_ports, start_process, stop_process

_MOVING = (
    b'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b'vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b'vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b'vllm:inter_token_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b'vllm:inter_token_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b'vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b"process_cpu_seconds_total ",
)


def _template() -> tuple[list[bytes], list[int]]:
    """The page split around the moving values (in page order), and which value each one is."""
    from bench.stubpods import metrics_page

    page = metrics_page()
    spans: list[tuple[int, int, int]] = []
    for which, prefix in enumerate(_MOVING):
        at = page.find(b"\n" + prefix)
        if at >= 0:
            start = at + 1 + len(prefix)
            spans.append((start, page.index(b"\n", start), which))
    spans.sort()
    parts, order, last = [], [], 0
    for start, end, which in spans:
        parts.append(page[last:start])
        order.append(which)
        last = end
    parts.append(page[last:])
    return parts, order


class _Pod:
    def __init__(self, parts: list[bytes], order: list[int], seed: int) -> None:
        self.parts = parts
        self.order = order
        self.n = seed

    def page(self) -> bytes:
        self.n += 1
        n = self.n
        values = (n % 7, n % 3, (n % 100) / 100, n * 0.031, n * 3, n * 211, n * 0.01)
        out = [self.parts[0]]
        for which, part in zip(self.order, self.parts[1:]):
            value = values[which]
            out.append(repr(float(value)).encode())
            out.append(part)
        return b"".join(out)


class _Http(asyncio.Protocol):
    def __init__(self, pod: _Pod, served: list[int]) -> None:
        self.pod = pod
        self.served = served  # pages served, all ports (GET /served answers it)
        self.transport: asyncio.Transport | None = None
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            if head.startswith(b"GET /served"):
                body = str(self.served[0]).encode()
            else:
                self.served[0] += 1
                body = self.pod.page()
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: "  # type: ignore[union-attr]
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _serve(ports: list[int]) -> None:
    parts, order = _template()
    loop = asyncio.get_running_loop()
    served = [0]
    for i, port in enumerate(ports):
        pod = _Pod(parts, order, seed=i * 1000)
        await loop.create_server(lambda pod=pod: _Http(pod, served), "127.0.0.1", port)
    await asyncio.Event().wait()


@dataclass(slots=True)
class MovingPages:
    count: int
    ports: list[int] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def __enter__(self) -> MovingPages:
        self.ports = free_ports(self.count)
        self.proc = start_process([sys.executable, "-m", "bench.moving_pages", *map(str, self.ports)],
                                  f"moving-pages-{self.count}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{self.addresses[-1]}/metrics", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise TimeoutError("moving pages did not start")

    def requests_served(self) -> int:
        """Pages served so far, over all ports."""
        with urllib.request.urlopen(f"http://{self.addresses[0]}/served", timeout=5) as r:
            return int(r.read())

    def __exit__(self, *exc: object) -> None:
        stop_process(self.proc)
        self.proc = None


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(_serve([int(p) for p in sys.argv[1:]]))
    except KeyboardInterrupt:
        pass
