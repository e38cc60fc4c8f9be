"""Many fake vLLM `/metrics` endpoints whose numbers move on every scrape, in one child process.

`bench/stubpods.py` serves a fixed page from Envoy: cheap, but a scraper that skips unchanged
pages (as this EPP's does) would be measured on its best case. Here every answer is the simulated
vLLM page (~55 KB, vLLM 0.32's families) with its gauges and counters changed, the way a busy
pod's are: queue, running, KV use, the token and ITL counters (monotonic), the process's CPU
seconds. One uvloop process answers all ports with a minimal keep-alive HTTP/1.1 responder; its
own CPU is not the EPP's, which is what the benchmarks measure.

Like vLLM's /metrics (prometheus_client's `make_asgi_app`), a request with `?name[]=...` gets only
the series of those names, each family with its HELP and TYPE lines (`restrict`); `whole=True`
serves the whole page whatever is asked, as a server without that filter does.

    with MovingPages(100) as pages: pages.addresses  # ["127.0.0.1:port", ...]
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import parse_qs

from bench.common import free_ports, start_process, stop_process
from epp.sim.exposition import restrict

_MOVING = (
    b'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b'vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b'vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b'vllm:inter_token_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b'vllm:inter_token_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b'vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} ',
    b"process_cpu_seconds_total ",
)


def _template(names: set[str] | None = None) -> tuple[list[bytes], list[int]]:
    """The page (restricted to `names`, if given) split around the moving values (in page order),
    and which value each one is."""
    from bench.stubpods import metrics_page

    page = metrics_page()
    if names:
        page = restrict(page, names)
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

    def page(self, template: tuple[list[bytes], list[int]] | None = None) -> bytes:
        """The next page: the whole one, or `template`'s (a restricted page), with the same values."""
        parts, order = template or (self.parts, self.order)
        self.n += 1
        n = self.n
        values = (n % 7, n % 3, (n % 100) / 100, n * 0.031, n * 3, n * 211, n * 0.01)
        out = [parts[0]]
        for which, part in zip(order, parts[1:]):
            value = values[which]
            out.append(repr(float(value)).encode())
            out.append(part)
        return b"".join(out)


class _Http(asyncio.Protocol):
    def __init__(self, pod: _Pod, served: list[int], templates: dict[bytes, tuple[list[bytes], list[int]]] | None
                 ) -> None:
        self.pod = pod
        self.served = served  # pages served, all ports (GET /served answers it)
        self.templates = templates  # restricted pages by query string (None: always the whole page)
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
                body = self.pod.page(self._template(head))
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: "  # type: ignore[union-attr]
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)


    def _template(self, head: bytes) -> tuple[list[bytes], list[int]] | None:
        target = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
        if self.templates is None or b"?" not in target:
            return None
        query = target.split(b"?", 1)[1]
        template = self.templates.get(query)
        if template is None:
            names = set(parse_qs(query.decode("latin-1")).get("name[]", ()))
            template = self.templates[query] = _template(names) if names else None  # type: ignore[assignment]
        return template


async def _serve(ports: list[int], whole: bool) -> None:
    parts, order = _template()
    loop = asyncio.get_running_loop()
    served = [0]
    templates: dict[bytes, tuple[list[bytes], list[int]]] | None = None if whole else {}
    for i, port in enumerate(ports):
        pod = _Pod(parts, order, seed=i * 1000)
        await loop.create_server(lambda pod=pod: _Http(pod, served, templates), "127.0.0.1", port)
    await asyncio.Event().wait()


@dataclass(slots=True)
class MovingPages:
    count: int
    whole: bool = False  # serve the whole page even to a request for some series (`restrict`)
    ports: list[int] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def __enter__(self) -> MovingPages:
        self.ports = free_ports(self.count)
        self.proc = start_process([sys.executable, "-m", "bench.moving_pages", *(["--whole"] if self.whole else []),
                                   *map(str, self.ports)], f"moving-pages-{self.count}")
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

        args = sys.argv[1:]
        uvloop.run(_serve([int(p) for p in args if p != "--whole"], "--whole" in args))
    except KeyboardInterrupt:
        pass
