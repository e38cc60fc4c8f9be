"""`epp slicer`: run the token-slice sidecar until SIGINT/SIGTERM (experimental).

    epp slicer --upstream http://gateway:8080 [--listen 127.0.0.1:8100] [--slice-tokens 128]

Point clients (or a route) at the slicer instead of the gateway; it forwards everything to
`--upstream` and serves long completions as slices (see `epp.slicer`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from urllib.parse import urlsplit

from aiohttp import web

from epp.datastore.endpoint import split_host_port
from epp.slicer.server import Slicer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", required=True, metavar="URL",
                        help="where every request goes: the gateway (so the EPP routes each slice) or a model server")
    parser.add_argument("--listen", default="127.0.0.1:8100", metavar="HOST:PORT",
                        help="address to serve on (default 127.0.0.1:8100)")
    parser.add_argument("--slice-tokens", type=int, default=128, metavar="S",
                        help="output tokens per slice (default 128)")
    parser.add_argument("--max-slices", type=int, default=256, help="slices one response may take (default 256)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="longest wait for a byte from the upstream (default 600)")


def build(args: argparse.Namespace) -> tuple[Slicer, str, int]:
    """The slicer and where it listens; ValueError with a message for bad arguments."""
    parts = urlsplit(args.upstream)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--upstream: expected http://host:port, got {args.upstream!r}")
    host, port = split_host_port(args.listen)
    if args.slice_tokens < 1 or args.max_slices < 1 or args.timeout <= 0:
        raise ValueError("--slice-tokens and --max-slices must be >= 1 and --timeout > 0")
    slicer = Slicer(args.upstream, slice_tokens=args.slice_tokens, max_slices=args.max_slices, timeout=args.timeout)
    return slicer, host, port


def run(args: argparse.Namespace) -> int:
    try:
        slicer, host, port = build(args)
    except ValueError as exc:
        print(f"epp slicer: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"epp slicer: {host}:{port} -> {slicer.upstream}, slices of {slicer.slice_tokens} tokens "
          f"(at most {slicer.max_slices} a response)", file=sys.stderr, flush=True)
    try:
        web.run_app(slicer.app(), host=host, port=port, print=None)
    except OSError as exc:
        print(f"epp slicer: {exc}", file=sys.stderr)
        return 1
    return 0
