"""`epp status`: a terminal view of a running EPP for an SRE, from its admin API.

Shows the pool's saturation, each endpoint's scraped signals with their age and our own
in-flight counts, the flow-control queues, and the latest decisions with the scores behind them.
"""

from __future__ import annotations

import time

import grpc

from epp.admin.v1 import admin_pb2, admin_pb2_grpc


def fetch(address: str, decisions: int = 10, timeout: float = 5.0) -> admin_pb2.Status:
    with grpc.insecure_channel(address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        return stub.GetStatus(admin_pb2.GetStatusRequest(decisions=decisions), timeout=timeout)


def _age(seconds: float) -> str:
    if seconds < 0:
        return "never"
    return f"{seconds * 1000:.0f}ms" if seconds < 10 else f"{seconds:.0f}s"


def render(status: admin_pb2.Status) -> str:
    saturated = "SATURATED" if status.pool_saturation >= 1.0 else "ok"
    lines = [
        f"pool {status.pool_namespace + '/' if status.pool_namespace else ''}{status.pool_name or '-'}   "
        f"ready={'yes' if status.ready else 'NO'}   saturation={status.pool_saturation:.2f} ({saturated})   "
        f"flow-control={'on' if status.flow_control_enabled else 'off'}   "
        f"requests={status.requests_total}   epp {status.version}, up {status.uptime_seconds:.0f}s",
        "",
        f"{'ENDPOINT':<24}{'WAIT':>6}{'RUN':>6}{'KV':>7}{'ITL':>8}{'INFLIGHT':>10}{'AGE':>8}  ERROR",
    ]
    for ep in status.endpoints:
        itl = f"{ep.inter_token_latency_seconds * 1000:.0f}ms" if ep.inter_token_latency_seconds else "-"
        lines.append(f"{ep.address:<24}{ep.waiting_queue_size:>6}{ep.running_requests:>6}{ep.kv_cache_usage:>7.0%}"
                     f"{itl:>8}{ep.inflight_requests:>10}{_age(ep.metrics_age_seconds):>8}  {ep.scrape_error[:60]}")
    if not status.endpoints:
        lines.append("(no endpoints)")
    else:
        lines += ["", f"{'SERVICE MODEL':<24}{'QUEUED':>9}{'DECODING':>10}{'PREFILL/s':>11}{'STEP':>8}"
                      f"{'x STEP':>8}{'x PREFILL':>10}{'x TTFT':>8}{'TTFT ERR':>10}{'SAMPLES':>9}{'SLOTS':>7}"]
        for ep in status.endpoints:
            lines.append(f"{ep.address:<24}{ep.queued_prefill_tokens:>9.0f}{ep.decoding_requests:>10}"
                         f"{ep.prefill_tokens_per_second:>11.0f}{ep.step_seconds * 1000:>6.1f}ms"
                         f"{ep.step_scale:>8.2f}{ep.prefill_scale:>10.2f}{ep.ttft_calibration or 1.0:>8.2f}"
                         f"{ep.ttft_prediction_error:>10.0%}"
                         f"{ep.service_observations:>9}{ep.batch_limit or '-':>7}")
    if status.flow_control_enabled:
        lines += ["", f"{'QUEUE priority':<16}{'FLOW':<24}{'REQUESTS':>10}{'BYTES':>12}{'OLDEST':>10}"]
        for q in status.queues:
            lines.append(f"{q.priority:<16}{q.fairness_id:<24}{q.requests:>10}{q.bytes:>12}{_age(q.oldest_seconds):>10}")
        if not status.queues:
            lines.append("(queues empty)")
    if status.decisions:
        lines += ["", "RECENT DECISIONS (newest first)"]
        for d in status.decisions:
            when = time.strftime("%H:%M:%S", time.localtime(d.time))
            head = (f"{when} {d.request_id[:12]:<12} {d.model[:28]:<28} flow={d.fairness_id} prio={d.priority} "
                    f"{d.outcome} {d.http_status}")
            if d.targets:
                head += f" -> {','.join(d.targets)}"
            if d.message:
                head += f" ({d.message[:60]})"
            lines.append(head)
            for c in sorted(d.candidates, key=lambda c: -c.total)[:4]:
                scores = " ".join(f"{k}={v:.2f}" for k, v in sorted(c.scores.items()))
                lines.append(f"    {c.address:<22} total={c.total:.2f}  {scores}")
    return "\n".join(lines)


def run_status(address: str, decisions: int, watch: float) -> int:
    try:
        while True:
            try:
                text = render(fetch(address, decisions))
            except grpc.RpcError as exc:
                print(f"error: cannot reach the EPP admin API at {address}: {exc.code().name}")  # noqa: T201
                return 1
            if watch > 0:
                print("\033[2J\033[H" + text, flush=True)  # noqa: T201
                time.sleep(watch)
            else:
                print(text)  # noqa: T201
                return 0
    except KeyboardInterrupt:
        return 0
