"""`epp sim`: run simulated vLLM (or, with `--engine tgi`, TGI) pods until SIGINT/SIGTERM.

The top-level CLI wires `add_arguments` into its `sim` sub-command and calls `run(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys

from epp.sim.config import SERVER_KINDS, EngineConfig, SimConfig
from epp.sim.kv_publisher import KVEventsConfig
from epp.sim.pool import describe_pool, engine_configs, parse_pods
from epp.sim.server import start_pods, stop_pods
from epp.sim.steptime import DEFAULT_PROFILE, kv_capacity_blocks, profiles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    eng = EngineConfig()
    sim = SimConfig()
    parser.add_argument("--pods", default="1", metavar="N|SPEC",
                        help="number of pods (default 1), or groups COUNT[:PROFILE][:KEY=VALUE...] joined "
                             "by commas, e.g. 2:h100,2:a100:max_num_seqs=64 (a group's profile sets its "
                             "step time and KV capacity; the other flags are the base)")
    parser.add_argument("--base-port", type=int, default=8001,
                        help="port of the first pod; pod i listens on base+i (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--model", default=sim.model, help=f"served model name (default {sim.model})")
    parser.add_argument("--engine", choices=SERVER_KINDS, default=sim.server,
                        help="model server to imitate: vllm (OpenAI API, vllm: metrics) or tgi (TGI's "
                             "/generate, /generate_stream, Messages API and tgi_ metrics)")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME",
                        help="a LoRA adapter name accepted as `model` (repeatable or comma-separated)")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="LoRA slots per batch (default 4 when --lora is given, else 0)")
    parser.add_argument("--time-scale", type=float, default=sim.time_scale,
                        help="wall seconds per simulated second; 0.1 runs 10x faster (default 1)")
    parser.add_argument("--seed", type=int, default=sim.seed)
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=profiles(),
                        help=f"step-time profile (default {DEFAULT_PROFILE})")
    parser.add_argument("--num-gpu-blocks", type=int, default=None,
                        help="KV-cache blocks of every pod, a --pods group's profile included (default: the profile's capacity)")
    parser.add_argument("--block-size", type=int, default=eng.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=eng.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=eng.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=eng.max_model_len)
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--batching", choices=("mixed", "prefill_first"), default="mixed",
                        help="mixed: vLLM v1 chunked-prefill batches; prefill_first: no mixing")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--default-max-tokens", type=int, default=sim.default_max_tokens)
    parser.add_argument("--mean-output-tokens", type=float, default=sim.mean_output_tokens,
                        help="mean output length when ignore_eos is not set")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="vLLM's flag: publish KV-cache events over ZMQ, e.g. "
                             '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                             '"topic": "kv@{ip}:{port}@{model}"}\' (pod i binds port+i; see epp/sim/README.md)')
    parser.add_argument("--tokenizer", default=sim.tokenizer, metavar="bpe|tiny|chars4|DIR",
                        help=f"how prompts become tokens (default {sim.tokenizer}: the project's byte-level "
                             "BPE; tiny: the vLLM captures' model; chars4: 4 characters per token; DIR: a "
                             "directory with a tokenizer.json and its chat template)")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    loras = tuple(n.strip() for item in args.lora for n in item.split(",") if n.strip())
    max_loras = args.max_loras if args.max_loras is not None else (4 if loras else 0)
    engine = EngineConfig(
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks or kv_capacity_blocks(args.profile),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        batching=args.batching,
        max_loras=max_loras,
        step_profile=args.profile,
        record_token_times=False,
    )
    cfg = SimConfig(model=args.model, lora_adapters=loras, time_scale=args.time_scale,
                    seed=args.seed, default_max_tokens=args.default_max_tokens,
                    mean_output_tokens=args.mean_output_tokens, engine=engine, server=args.engine,
                    tokenizer=args.tokenizer)
    cfg.validate()
    return cfg


def kv_events_from_args(args: argparse.Namespace, pods: int) -> KVEventsConfig | None:
    """`--kv-events-config`, validated for `pods` pods; vLLM's warnings printed."""
    if args.kv_events_config is None:
        return None
    kv = KVEventsConfig.from_json(args.kv_events_config)
    kv.check_pods(pods)
    warnings = kv.warnings()
    if kv.enabled and args.no_prefix_caching:
        warnings.append("KV cache events are on, but prefix caching is not enabled: no blocks will be stored")
    for warning in warnings:
        print(f"epp sim: warning: {warning}", file=sys.stderr)
    return kv


def dev_mode_from_env() -> bool:
    """VLLM_SERVER_DEV_MODE, read as vLLM reads it (an integer; non-zero serves the dev endpoints)."""
    raw = os.environ.get("VLLM_SERVER_DEV_MODE", "0")
    try:
        return bool(int(raw))
    except ValueError:
        raise ValueError(f"VLLM_SERVER_DEV_MODE must be an integer (0 or 1), got {raw!r}") from None


def pod_configs(args: argparse.Namespace, base: SimConfig) -> list[SimConfig]:
    """One configuration per pod from `--pods` (a count, or groups of pod shapes)."""
    groups = parse_pods(args.pods)
    out = []
    explicit = ("num_gpu_blocks",) if args.num_gpu_blocks else ()
    for engine in engine_configs(groups, base.engine, explicit):
        cfg = dataclasses.replace(base, engine=engine)
        cfg.validate()
        out.append(cfg)
    return out


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        configs = pod_configs(args, cfg)
        kv_events = kv_events_from_args(args, len(configs))
        dev_mode = dev_mode_from_env()
    except ValueError as e:
        print(f"epp sim: {e}", file=sys.stderr)
        return 2
    groups = parse_pods(args.pods)
    if len(groups) > 1 or groups[0].profile or groups[0].settings:
        print(f"epp sim: pods {describe_pool(groups, cfg.engine.step_profile)}", file=sys.stderr, flush=True)
    try:
        asyncio.run(_serve(configs, args.base_port, args.host, kv_events, dev_mode))
    except OSError as e:
        print(f"epp sim: {e}", file=sys.stderr)
        return 1
    return 0


async def _serve(configs: list[SimConfig], base_port: int, host: str, kv_events: KVEventsConfig | None = None,
                 dev_mode: bool = False) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pods = await start_pods(len(configs), base_port=base_port, host=host, configs=configs, kv_events=kv_events,
                            dev_mode=dev_mode)
    try:
        for pod in pods:
            cfg, e = pod.config, pod.config.engine
            extra = " dev-mode" if dev_mode else ""
            if (pub := pod.kv_publisher) is not None:
                mode = "bind" if pub.settings.bind else "connect"
                extra += f" kv-events={pub.endpoint} ({mode}) topic={pub.settings.topic!r}"
                if pub.replay_endpoint:
                    extra += f" replay={pub.replay_endpoint}"
            engine = f" engine={cfg.server}" if cfg.server != "vllm" else ""
            print(f"{pod.name} {pod.url} model={cfg.model} tokenizer={cfg.tokenizer}{engine} profile={e.step_profile} "
                  f"num_gpu_blocks={e.num_gpu_blocks} max_num_seqs={e.max_num_seqs}{extra}", flush=True)
        await stop.wait()
    finally:
        await stop_pods(pods)
