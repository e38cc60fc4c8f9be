"""Structured JSON logs with the reference's verbosity levels (2 default, 3 verbose, 4 debug, 5 trace).

At the default level nothing is logged per request; decision traces appear at 4.
"""

from __future__ import annotations

import logging
import sys
import time

import orjson

TRACE = 5  # below DEBUG
VERBOSE = 15  # between DEBUG and INFO
logging.addLevelName(TRACE, "TRACE")
logging.addLevelName(VERBOSE, "VERBOSE")

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def level_for_verbosity(v: int) -> int:
    if v <= 1:
        return logging.WARNING
    return {2: logging.INFO, 3: VERBOSE, 4: logging.DEBUG}.get(v, TRACE)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def setup_logging(v: int = 2, json_format: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_format else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_for_verbosity(v))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
