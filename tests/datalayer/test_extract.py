from __future__ import annotations

import pytest

from epp.datalayer.core_metrics_extractor import CoreMetricsExtractor
from epp.datalayer.engines import BUILTIN_ENGINES, EngineMapping, specs
from epp.datalayer.extract import extract_metrics
from epp.datalayer.promparse import MetricsParseError
from epp.datastore import EMPTY_METRICS, Endpoint, EndpointMetrics, EndpointSpec

from .helpers import fixture_body

VLLM = BUILTIN_ENGINES["vllm"]

SGLANG_TEXT = b"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 3.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.41
# TYPE sglang:cache_config_info gauge
sglang:cache_config_info{model_name="qwen",num_pages="8192",page_size="16"} 1.0
"""

TRTLLM_SERVE_TEXT = b"""\
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{model_name="llama"} 2
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{model_name="llama"} 5
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{model_name="llama"} 0.125
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{model_name="llama"} 32
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{model_name="llama"} 19958
"""

TRITON_TEXT = b"""\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 3
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 512
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 6
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 4096
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 3000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.267578125
"""


def endpoint(engine: str = "vllm", labels: tuple[tuple[str, str], ...] = ()) -> Endpoint:
    return Endpoint(EndpointSpec("pod-a", "10.0.0.1", 8000, labels=labels, engine=engine))


def test_vllm_fixture_busy() -> None:
    result = extract_metrics(VLLM, fixture_body("busy"), EMPTY_METRICS, now=12.5)
    assert result.problems == ()
    assert result.metrics == EndpointMetrics(
        waiting_queue_size=8, running_requests=4, kv_cache_usage=14 / 63, models=frozenset({"tiny"}),
        cache_block_size=128, cache_num_blocks=64, update_time=12.5,
        max_model_len=1024,  # kv_cache_size_tokens 8192 / kv_cache_max_concurrency 8.0: models.json's 1024
    )


def test_vllm_all_fixtures_extract(vllm_fixture: tuple[str, bytes]) -> None:
    result = extract_metrics(VLLM, vllm_fixture[1], EMPTY_METRICS, now=1.0)
    assert result.metrics is not None and result.problems == ()
    assert (result.metrics.cache_block_size, result.metrics.cache_num_blocks) == (128, 64)


def test_gpu_cache_usage_perc_is_the_fallback_for_older_vllm() -> None:
    old = b"vllm:num_requests_waiting 1\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n"
    result = extract_metrics(VLLM, old, EMPTY_METRICS, now=1.0)
    assert result.metrics is not None and result.metrics.kv_cache_usage == 0.5
    both = b"vllm:kv_cache_usage_perc 0.25\nvllm:gpu_cache_usage_perc 0.5\n"
    result = extract_metrics(VLLM, both, EMPTY_METRICS, now=1.0)
    assert result.metrics is not None and result.metrics.kv_cache_usage == 0.25


def test_kv_usage_missing_under_both_names_is_reported() -> None:
    result = extract_metrics(VLLM, b"vllm:num_requests_running 2\n", EMPTY_METRICS, now=1.0)
    assert result.metrics is not None and result.metrics.running_requests == 2
    assert "vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc: not found" in result.problems
    assert not any("lora" in p for p in result.problems)  # LoRA off is normal


def test_lora_series_with_largest_value_wins() -> None:
    body = b"""\
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a1, a2,",waiting_lora_adapters="w1"} 1.9e9
vllm:lora_requests_info{max_lora="3",running_lora_adapters="mid",waiting_lora_adapters=""} 1.8e9
vllm:lora_requests_info{max_lora="9",running_lora_adapters="nan",waiting_lora_adapters=""} NaN
"""
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is not None
    assert result.metrics.active_models == frozenset({"a1", "a2"})
    assert result.metrics.waiting_models == frozenset({"w1"})
    assert result.metrics.max_active_models == 4


def test_lora_bad_max_lora_is_a_problem_not_a_crash() -> None:
    body = b'vllm:lora_requests_info{max_lora="lots",running_lora_adapters="a"} 1\n'
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is not None and result.metrics.active_models == frozenset({"a"})
    assert any("max_lora" in p for p in result.problems)


def test_newest_timestamp_wins_then_first_series() -> None:
    mapping = EngineMapping("t", queued=specs('q{engine="0"}'), running=specs("r"))
    body = b"""\
q{engine="0"} 5 1000
q{engine="0"} 9 3000
q{engine="1"} 100 9000
q{engine="0"} 7 2000
r{x="first"} 1
r{x="second"} 2
"""
    result = extract_metrics(mapping, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is not None
    assert result.metrics.waiting_queue_size == 9
    assert result.metrics.running_requests == 1


def test_fields_not_found_keep_their_previous_value() -> None:
    previous = EndpointMetrics(waiting_queue_size=3, running_requests=2, kv_cache_usage=0.5,
                               cache_block_size=16, cache_num_blocks=100, update_time=1.0)
    result = extract_metrics(VLLM, b"vllm:num_requests_running 6\n", previous, now=2.0)
    assert result.metrics == EndpointMetrics(waiting_queue_size=3, running_requests=6, kv_cache_usage=0.5,
                                             cache_block_size=16, cache_num_blocks=100, update_time=2.0)


def test_nothing_found_gives_no_metrics() -> None:
    result = extract_metrics(VLLM, b"# nothing here\nother 1\n", EMPTY_METRICS, now=1.0)
    assert result.metrics is None
    assert "vllm:num_requests_waiting: not found" in result.problems


def test_non_finite_values_make_the_scrape_invalid() -> None:
    body = b"vllm:num_requests_waiting NaN\nvllm:num_requests_running +Inf\nvllm:kv_cache_usage_perc 0.5\n"
    previous = EndpointMetrics(waiting_queue_size=1, running_requests=1)
    result = extract_metrics(VLLM, body, previous, now=1.0)
    assert result.metrics is None  # nothing of a scrape with garbage in it is used
    assert [i.metric for i in result.invalid] == ["vllm:num_requests_waiting", "vllm:num_requests_running"]
    assert "nan" in result.invalid[0].detail and "inf" in result.invalid[1].detail


VALID = {"vllm:num_requests_waiting": "2", "vllm:num_requests_running": "3", "vllm:kv_cache_usage_perc": "0.5"}


def vllm_body(**values: str) -> bytes:
    """A vLLM exposition with the three load gauges, some replaced (keys with `:` as `__`)."""
    merged = dict(VALID)
    merged.update({k.replace("__", ":"): v for k, v in values.items()})
    return "".join(f'{name}{{engine="0",model_name="m"}} {value}\n' for name, value in merged.items()).encode()


@pytest.mark.parametrize("metric,value", [
    ("vllm:kv_cache_usage_perc", "1e308"),
    ("vllm:kv_cache_usage_perc", "85"),  # a percentage: a wrong unit, not "very full"
    ("vllm:kv_cache_usage_perc", "1.0000001"),
    ("vllm:kv_cache_usage_perc", "-0.1"),
    ("vllm:kv_cache_usage_perc", "NaN"),
    ("vllm:num_requests_waiting", "NaN"),
    ("vllm:num_requests_waiting", "+Inf"),
    ("vllm:num_requests_waiting", "-Inf"),
    ("vllm:num_requests_waiting", "-5e300"),
    ("vllm:num_requests_waiting", "-1"),
    ("vllm:num_requests_waiting", "2.5"),  # a count is a whole number
    ("vllm:num_requests_waiting", "1e12"),
    ("vllm:num_requests_running", "1e308"),
    ("vllm:num_requests_running", "-Inf"),
])
def test_each_hostile_value_makes_the_scrape_invalid(metric: str, value: str) -> None:
    previous = EndpointMetrics(waiting_queue_size=1, running_requests=1, kv_cache_usage=0.1, update_time=0.5)
    result = extract_metrics(VLLM, vllm_body(**{metric.replace(":", "__"): value}), previous, now=1.0)
    assert result.metrics is None
    assert [i.metric for i in result.invalid] == [metric]


def test_bounds_themselves_are_valid() -> None:
    body = vllm_body(vllm__kv_cache_usage_perc="1", vllm__num_requests_waiting="0",
                     vllm__num_requests_running="1000000")
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.invalid == () and result.metrics is not None
    assert (result.metrics.kv_cache_usage, result.metrics.running_requests) == (1.0, 1_000_000)


@pytest.mark.parametrize("labels,why", [
    ('block_size="0",num_gpu_blocks="64"', "block size"),
    ('block_size="-16",num_gpu_blocks="64"', "block size"),
    ('block_size="16",num_gpu_blocks="0"', "block count"),
    ('block_size="99999999999",num_gpu_blocks="64"', "block size"),
    ('block_size="16",num_gpu_blocks="99999999999999999"', "block count"),
])
def test_cache_info_out_of_bounds_is_invalid(labels: str, why: str) -> None:
    body = vllm_body() + f"vllm:cache_config_info{{{labels}}} 1\n".encode()
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is None and why in result.invalid[0].detail


def test_lora_labels_are_bounded() -> None:
    long_name = "a" * 2000
    body = vllm_body() + f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{long_name}"}} 1\n'.encode()
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is None and "2000 characters" in str(result.invalid[0])
    many = ",".join(f"a{i}" for i in range(5000))
    body = vllm_body() + f'vllm:lora_requests_info{{max_lora="4",waiting_lora_adapters="{many}"}} 1\n'.encode()
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is None and "5000" in str(result.invalid[0])
    body = vllm_body() + b'vllm:lora_requests_info{max_lora="-3",running_lora_adapters="a"} 1\n'
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is None and "max_lora" in str(result.invalid[0])


def test_all_the_names_of_a_scrape_fit_a_board_slot() -> None:
    from epp.datalayer.validate import MAX_NAME_BYTES

    names = [f"adapter-{i:04d}-" + "x" * 100 for i in range(MAX_NAME_BYTES // 100)]  # each short, many
    body = vllm_body() + f'vllm:lora_requests_info{{max_lora="4",waiting_lora_adapters="{",".join(names)}"}} 1\n'.encode()
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is None and result.invalid[0].metric == "vllm:lora_requests_info"
    assert f"at most {MAX_NAME_BYTES}" in result.invalid[0].detail
    fewer = ",".join(names[:50])
    body = vllm_body() + f'vllm:lora_requests_info{{max_lora="4",waiting_lora_adapters="{fewer}"}} 1\n'.encode()
    assert extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0).metrics is not None


def test_model_names_are_read_and_bounded() -> None:
    result = extract_metrics(VLLM, vllm_body(), EMPTY_METRICS, now=1.0)
    assert result.metrics is not None and result.metrics.models == frozenset({"m"})
    body = vllm_body().replace(b'model_name="m"', b'model_name="' + b"x" * 5000 + b'"')
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is None and result.invalid[0].metric == "model_name"


def test_inter_token_latency_totals_are_bounded() -> None:
    body = vllm_body() + b"vllm:inter_token_latency_seconds_sum -4\nvllm:inter_token_latency_seconds_count 10\n"
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is None and result.invalid[0].metric == "vllm:inter_token_latency_seconds_sum"
    body = vllm_body() + b"vllm:inter_token_latency_seconds_sum 4\nvllm:inter_token_latency_seconds_count NaN\n"
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is None and result.invalid[0].metric == "vllm:inter_token_latency_seconds_count"


def test_bad_cache_info_labels_are_problems() -> None:
    body = b'vllm:num_requests_waiting 0\nvllm:cache_config_info{block_size="None"} 1\n'
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is not None and result.metrics.cache_block_size == 0
    assert any("block_size='None'" in p for p in result.problems)
    assert any("no label num_gpu_blocks" in p for p in result.problems)


def test_garbage_in_a_wanted_line_raises() -> None:
    with pytest.raises(MetricsParseError):
        extract_metrics(VLLM, b'vllm:num_requests_waiting{engine="0', EMPTY_METRICS, now=1.0)


def test_sglang() -> None:
    result = extract_metrics(BUILTIN_ENGINES["sglang"], SGLANG_TEXT, EMPTY_METRICS, now=1.0)
    assert result.problems == ()
    assert result.metrics == EndpointMetrics(waiting_queue_size=3, running_requests=7, kv_cache_usage=0.41,
                                             models=frozenset({"qwen"}), cache_block_size=16, cache_num_blocks=8192, update_time=1.0)


def test_trtllm_serve() -> None:
    result = extract_metrics(BUILTIN_ENGINES["trtllm-serve"], TRTLLM_SERVE_TEXT, EMPTY_METRICS, now=1.0)
    assert result.problems == ()
    assert result.metrics == EndpointMetrics(waiting_queue_size=2, running_requests=5, kv_cache_usage=0.125,
                                             models=frozenset({"llama"}), cache_block_size=32, cache_num_blocks=19958, update_time=1.0)


def test_triton_tensorrt_llm_selects_series_by_label() -> None:
    result = extract_metrics(BUILTIN_ENGINES["triton-tensorrt-llm"], TRITON_TEXT, EMPTY_METRICS, now=1.0)
    assert result.problems == ()
    assert result.metrics == EndpointMetrics(waiting_queue_size=6, running_requests=3, kv_cache_usage=0.267578125,
                                             cache_block_size=64, cache_num_blocks=4096, update_time=1.0)


# -- engine choice per endpoint --


def test_engine_comes_from_label_then_spec_then_default() -> None:
    ex = CoreMetricsExtractor(default_engine="sglang")
    assert ex.engine_of(endpoint("vllm", (("inference.networking.k8s.io/engine-type", "trtllm-serve"),))) \
        == "trtllm-serve"
    assert ex.engine_of(endpoint("vllm")) == "vllm"
    assert ex.engine_of(endpoint("")) == "sglang"
    custom = CoreMetricsExtractor(engine_label_key="example.com/engine")
    assert custom.engine_of(endpoint("vllm", (("example.com/engine", "sglang"),))) == "sglang"


def test_each_endpoint_is_read_with_its_engine_and_unknown_engines_use_the_default() -> None:
    ex = CoreMetricsExtractor()
    sg = ex.extract(endpoint("sglang"), SGLANG_TEXT, now=1.0)
    assert sg.metrics is not None and sg.metrics.running_requests == 7
    other = ex.extract(endpoint("llamacpp"), fixture_body("busy"), now=1.0)  # unknown: vLLM's
    assert other.metrics is not None and other.metrics.running_requests == 4
    assert ex.mapping_for("llamacpp") is ex.engines["vllm"]


def test_extract_builds_on_the_endpoints_current_metrics() -> None:
    ep = endpoint()
    ep.metrics = EndpointMetrics(cache_block_size=16, update_time=1.0)
    result = CoreMetricsExtractor().extract(ep, b"vllm:num_requests_running 3\n", now=5.0)
    assert result.metrics == EndpointMetrics(running_requests=3, cache_block_size=16, update_time=5.0)


def test_builtin_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        BUILTIN_ENGINES["x"] = VLLM  # type: ignore[index]
    assert set(BUILTIN_ENGINES) == {"vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm", "tgi"}


def _full(metrics: EndpointMetrics | None) -> tuple[object, ...] | None:
    """Every field, the ITL baseline too (left out of `==`)."""
    return None if metrics is None else (metrics, metrics.itl_sum, metrics.itl_count, metrics.update_time)


@pytest.mark.parametrize("asked", [False, True], ids=["whole page", "series asked for"])
def test_a_remembered_page_whose_numbers_moved_extracts_as_a_fresh_one(asked: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The page memory's shortcuts (the same page again; only numbers moved: read only them
    again, by the page's template when it is small, as a `?name[]=` page is) give what a full
    extraction gives, poll after poll, whatever the pod does to its page: values in and out of
    bounds or not numbers, counters that go backwards, timestamps, a new cache config, LoRA
    appearing and changing, the model renamed, a second engine, the same page twice."""
    import random
    from urllib.parse import parse_qs

    from epp.datalayer import extract
    from epp.datalayer.promparse import PageMemory
    from epp.sim.exposition import restrict

    parses = [0]
    parse_wanted = extract.parse_wanted

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        parses[0] += 1
        return parse_wanted(*args, **kwargs)

    monkeypatch.setattr(extract, "parse_wanted", counted)
    rng = random.Random(3)
    base = fixture_body("busy")
    if asked:
        base = restrict(base, set(parse_qs(VLLM.query)["name[]"]))
        assert len(base) < 4096
    lora = (b'# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{max_lora="4",'
            b'running_lora_adapters="a1",waiting_lora_adapters=""} 1.9e9\n')
    memory = PageMemory(recheck_absent=0)
    remembered = fresh = EMPTY_METRICS
    itl_count, itl_sum = 3468.0, 12.5
    shortcuts = unparsed = 0
    page = base
    for poll in range(600):
        if rng.random() < 0.05:  # the same page again
            now = 1.0 + poll
            before = parses[0]
            a = extract_metrics(VLLM, page, remembered, now, memory)
            b = extract_metrics(VLLM, page, fresh, now)
            unparsed += parses[0] == before + 1
            assert (_full(a.metrics), a.problems, a.invalid) == (_full(b.metrics), b.problems, b.invalid), poll
            remembered = a.metrics or remembered
            fresh = b.metrics or fresh
            continue
        page = base
        running = rng.choice((0, 1, 4, 7, 300, -1, float("nan"))) if rng.random() < 0.1 else rng.randrange(8)
        kv = rng.choice((1.5, -0.1, float("inf"))) if rng.random() < 0.05 else rng.random()
        if rng.random() < 0.05:
            itl_count, itl_sum = itl_count / 2, itl_sum / 2  # a restarted server
        else:
            itl_count, itl_sum = itl_count + rng.randrange(3), itl_sum + rng.random()
        page = page.replace(b'num_requests_running{engine="0",model_name="tiny"} 4.0',
                            b'num_requests_running{engine="0",model_name="tiny"} ' + repr(float(running)).encode())
        kv_text = repr(kv).encode() if rng.random() > 0.01 else rng.choice((b"x1", b"1..0", b"0x1"))
        page = page.replace(b'kv_cache_usage_perc{engine="0",model_name="tiny"} 0.2222222222222222',
                            b'kv_cache_usage_perc{engine="0",model_name="tiny"} ' + kv_text)
        page = page.replace(b'seconds_count{engine="0",model_name="tiny"} 3468.0',
                            b'seconds_count{engine="0",model_name="tiny"} ' + repr(itl_count).encode())
        page = page.replace(b'seconds_sum{engine="0",model_name="tiny"} 12.688387210999508',
                            b'seconds_sum{engine="0",model_name="tiny"} ' + repr(itl_sum).encode())
        phase = (poll // 60) % 6
        if phase == 1:
            page = page.replace(b'block_size="128"', b'block_size="' + str(16 << (poll % 3)).encode() + b'"')
        elif phase == 2:  # LoRA appears; then two series whose values (which one wins) swap
            second = b'vllm:lora_requests_info{max_lora="4",running_lora_adapters="b",waiting_lora_adapters=""} '
            page += lora if poll % 60 < 10 else lora + second + (b"1.8e9\n" if poll % 2 else b"2.0e9\n")
        elif phase == 3:
            page = page.replace(b'model_name="tiny"', b'model_name="tiny-' + str(poll % 2).encode() + b'"')
        elif phase == 4:
            page = page.replace(b'num_requests_waiting{engine="0",model_name="tiny"} 8.0',
                                b'num_requests_waiting{engine="0",model_name="tiny"} 8.0 ' + str(poll).encode())
        elif phase == 5 and poll % 2:
            page = page.replace(b'vllm:num_requests_running{engine="0",model_name="tiny"}',
                                b'vllm:num_requests_running{engine="1",model_name="tiny"} 3\n'
                                b'vllm:num_requests_running{engine="0",model_name="tiny"}')
        now = 1.0 + poll
        before = parses[0]
        try:
            a = extract_metrics(VLLM, page, remembered, now, memory)
        except MetricsParseError as exc:
            with pytest.raises(MetricsParseError, match=str(exc)):
                extract_metrics(VLLM, page, fresh, now)
            continue
        b = extract_metrics(VLLM, page, fresh, now)
        shortcuts += memory.same_labels and not memory.unchanged
        unparsed += parses[0] == before + 1
        assert (_full(a.metrics), a.problems, a.invalid) == (_full(b.metrics), b.problems, b.invalid), poll
        remembered = a.metrics or remembered
        fresh = b.metrics or fresh
    assert shortcuts > 200
    # Pages read without being parsed: the same page again; and when small, a template match.
    assert unparsed > (100 if asked else 10), unparsed


@pytest.mark.parametrize(("size", "concurrency", "longest"), [
    ("8192", "8.0", 1024), ("8192", "0.5", 16384), ("8192", "0", 0), ("8192", "0.0", 0), ("8192", "NaN", 0),
    ("8192", "-8", 0), ("8192", "inf", 0), ("1e300", "1", 0), ("x", "8", 0), ("8192", "None", 0),
    ("8" * 40, "8", 0),
])
def test_max_model_len_is_read_from_the_cache_config_or_left_unknown(size: str, concurrency: str, longest: int) -> None:
    """vLLM has no label of its own for it: kv_cache_size_tokens / kv_cache_max_concurrency. A pod
    writes both, so a value that is not a sensible length leaves it unknown (0), not invalid: the
    rest of the scrape stands."""
    body = (fixture_body("busy").replace(b'kv_cache_size_tokens="8192"', f'kv_cache_size_tokens="{size}"'.encode())
            .replace(b'kv_cache_max_concurrency="8.0"', f'kv_cache_max_concurrency="{concurrency}"'.encode()))
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is not None and result.problems == ()
    assert result.metrics.max_model_len == longest and result.metrics.cache_num_blocks == 64


def test_max_model_len_absent_from_an_older_vllm_is_unknown() -> None:
    body = fixture_body("busy").replace(b'kv_cache_max_concurrency="8.0",', b"")
    result = extract_metrics(VLLM, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is not None and result.metrics.max_model_len == 0 and result.problems == ()
