"""`epp`: one entry point for serving, simulating and inspecting."""

from __future__ import annotations

import argparse
import asyncio
import sys

from epp import __version__


def _run_async(coro) -> None:  # type: ignore[no-untyped-def]
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def cmd_serve(args: argparse.Namespace) -> int:
    from epp.config.options import options_from_args
    from epp.params import ConfigError
    from epp.observability.logging import setup_logging
    from epp.runner import serve

    options = options_from_args(args)
    setup_logging(options.v)
    try:
        _run_async(serve(options))
    except ConfigError as exc:
        print(f"error: invalid config: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    """Exit 0 when valid, 2 when invalid, 1 when valid with warnings and `--strict`."""
    from epp.config.effective import to_yaml
    from epp.config.loader import load_config
    from epp.datastore import Datastore
    from epp.params import ConfigError

    from epp.config.defaults import PRESETS

    text = open(args.config_file).read() if args.config_file else PRESETS.get(args.preset) if args.preset else None
    try:
        loaded = load_config(text, Datastore())
    except ConfigError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 2
    for warning in loaded.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.effective:
        print(to_yaml(loaded.effective()), end="")
    if loaded.warnings and args.strict:
        print(f"invalid with --strict: {len(loaded.warnings)} warning(s)", file=sys.stderr)
        return 1
    if not args.effective:
        print(f"ok: profiles {', '.join(loaded.scheduler.profiles)}"
              + (f" ({len(loaded.warnings)} warning(s))" if loaded.warnings else ""))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from epp.local.demo import run_demo

    return run_demo(duration=args.duration, pods=args.pods, compare=args.compare)


def cmd_status(args: argparse.Namespace) -> int:
    from epp.status import run_status

    return run_status(args.address, args.decisions, args.watch)


def cmd_sim(args: argparse.Namespace) -> int:
    from epp.sim.cli import run

    return run(args)


def cmd_simulate(args: argparse.Namespace) -> int:
    from epp.sim.cluster.cli import run

    return run(args)


def cmd_slicer(args: argparse.Namespace) -> int:
    from epp.slicer.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"epp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from epp.config.options import add_serve_arguments

    serve = sub.add_parser("serve", help="run the endpoint picker (Envoy ext_proc service)")
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check-config", help="validate an EndpointPickerConfig file")
    check.add_argument("config_file", nargs="?", default="", help="YAML file; none checks the built-in default")
    check.add_argument("--strict", action="store_true", help="exit 1 when the config has warnings")
    check.add_argument("--preset", default="", help="check a built-in preset (predicted-latency, weighted, reference)")
    check.add_argument("--effective", action="store_true",
                       help="print the effective configuration (YAML): every plugin, weight and default injected")
    check.set_defaults(func=cmd_check_config)

    status = sub.add_parser("status", help="show a running EPP: endpoints, saturation, queues, decisions")
    status.add_argument("--address", default="127.0.0.1:9004", help="the EPP's admin API (--admin-port)")
    status.add_argument("--decisions", type=int, default=10, help="recent decisions to show")
    status.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="refresh every N seconds")
    status.set_defaults(func=cmd_status)

    demo = sub.add_parser("demo", help="Envoy + EPP + simulated vLLM pods on localhost, with traffic and a summary")
    demo.add_argument("--duration", type=float, default=20.0, help="seconds of traffic")
    demo.add_argument("--pods", type=int, default=3, help="simulated model-server pods")
    demo.add_argument("--compare", action="store_true",
                      help="then send the same traffic through Envoy round-robin, and compare")
    demo.set_defaults(func=cmd_demo)

    sim = sub.add_parser("sim", help="run simulated vLLM pods over HTTP")
    try:
        from epp.sim.cli import add_arguments

        add_arguments(sim)
    except ImportError:
        pass
    sim.set_defaults(func=cmd_sim)

    simulate = sub.add_parser("simulate", help="try a picker config on a workload: N simulated pods in virtual time")
    from epp.sim.cluster.cli import add_arguments as add_simulate_arguments

    add_simulate_arguments(simulate)
    simulate.set_defaults(func=cmd_simulate)

    slicer = sub.add_parser("slicer", help="(experimental) serve long generations as token slices behind one response")
    from epp.slicer.cli import add_arguments as add_slicer_arguments

    add_slicer_arguments(slicer)
    slicer.set_defaults(func=cmd_slicer)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
