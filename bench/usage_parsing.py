"""What reading usage costs per streamed response, per API, as ratios to OpenAI's in one run.

The response observer runs once per response chunk on the request path. Each API keeps usage
somewhere else (epp/api/response.py): OpenAI in one `usage` event, TGI in its last event, SGLang
in every (cumulative) event. This feeds the same number of tokens, one event per chunk as a
model server flushes them, through each observer, interleaving the APIs so noise hits all alike.

    python -m bench.usage_parsing [--tokens 500] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import orjson

from epp.api.apis import Api
from epp.api.response import ResponseObserver


def openai_stream(n: int) -> list[bytes]:
    head = '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":'
    events = [f'data: {head}[{{"index":0,"text":" tok","logprobs":null,"finish_reason":null}}]}}\n\n'.encode()
              for _ in range(n)]
    usage = orjson.dumps({"prompt_tokens": 100, "completion_tokens": n, "total_tokens": 100 + n}).decode()
    return events + [f'data: {head}[],"usage":{usage}}}\n\n'.encode(), b"data: [DONE]\n\n"]


def tgi_stream(n: int) -> list[bytes]:
    token = '{"id":1001,"text":" tok","logprob":-0.25,"special":false}'
    events = [f'data:{{"index":{i + 1},"token":{token},"generated_text":null,"details":null}}\n\n'.encode()
              for i in range(n - 1)]
    details = '{"finish_reason":"length","generated_tokens":%d,"seed":null,"input_length":100}' % n
    return events + [f'data:{{"index":{n},"token":{token},"generated_text":"{" tok" * n}",'
                     f'"details":{details}}}\n\n'.encode()]


def sglang_stream(n: int) -> list[bytes]:
    events = []
    for i in range(n):
        meta = {"id": "r", "finish_reason": None, "prompt_tokens": 100, "completion_tokens": i + 1, "cached_tokens": 0}
        events.append(b"data: " + orjson.dumps({"text": " tok" * (i + 1), "meta_info": meta}) + b"\n\n")
    return events + [b"data: [DONE]\n\n"]


def once(api: Api, chunks: list[bytes], tokens: int) -> float:
    started = time.perf_counter()
    observer = ResponseObserver(streaming=True, api=api, prompt_estimate=100)
    for chunk in chunks:
        observer.feed(chunk)
    usage = observer.finish()
    elapsed = time.perf_counter() - started
    assert usage is not None and usage.completion_tokens == tokens, usage
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    cases = {"openai": (Api.COMPLETIONS, openai_stream(args.tokens)),
             "tgi": (Api.TGI_GENERATE_STREAM, tgi_stream(args.tokens)),
             "sglang": (Api.SGLANG_GENERATE, sglang_stream(args.tokens))}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (api, chunks) in cases.items():
            times[name].append(once(api, chunks, args.tokens))
    def per_kib(name: str) -> float:
        return statistics.median(times[name]) / (sum(map(len, cases[name][1])) / 1024)

    base = statistics.median(times["openai"])
    print(f"usage parsing, one stream of {args.tokens} tokens (one event per chunk), median of {args.rounds}")
    print("  api      per response   per KiB of stream   (SGLang repeats the whole text in every event)")
    for name, samples in times.items():
        print(f"  {name:<7} {statistics.median(samples) / base:6.2f} x openai   "
              f"{per_kib(name) / per_kib('openai'):5.2f} x openai   "
              f"({statistics.median(samples) / len(cases[name][1]) * 1e6:.2f} us per chunk)")


if __name__ == "__main__":
    main()
