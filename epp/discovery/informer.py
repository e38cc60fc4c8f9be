"""List+watch of one collection in a background thread, events handed to the asyncio loop.

Why a thread: the official `kubernetes` client is synchronous, and a watch is a long blocking
read. The thread only moves bytes and parses JSON; every event is applied on the loop (via
`call_soon_threadsafe`), so the datastore is only ever touched from one thread.

The protocol, as client-go's reflector speaks it:
- list (a full `SYNC` event), then watch from the list's resourceVersion;
- a watch that ends (server timeout, dropped connection) resumes from the last version seen;
- `410 Gone` (an ERROR event or an HTTP 410) means history was compacted: relist at once;
- a broken connection: back off exponentially (capped), then watch again from the same version;
- any other error (an API error status): back off, then relist;
- every `resync_period` the watch is closed and the collection relisted, so a lost event can
  never leave the cache wrong for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from urllib3.exceptions import HTTPError

log = logging.getLogger("epp.discovery")


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: str  # SYNC (a full listing in `items`) | ADDED | MODIFIED | DELETED
    obj: dict[str, Any] = field(default_factory=dict)
    items: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class WatchTuning:
    resync_period: float = 300.0
    backoff_initial: float = 0.2
    backoff_max: float = 30.0
    request_timeout: float = 30.0  # connect/read timeout of a list; a watch adds its own duration


DEFAULT_TUNING = WatchTuning()


class Gone(Exception):
    """The resourceVersion we watch from is older than the apiserver's history."""


class WatchBroken(Exception):
    """The watch connection failed (not the apiserver's answer): resume from the same version."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(_describe(cause))


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


ListCall = Callable[..., Any]  # a `kubernetes` list_* method with its path arguments bound


class Informer:
    """Keeps one collection flowing to `deliver` until `stop()`.

    `list_call(**kwargs)` must be a bound list method of the official client, e.g.
    `functools.partial(CoreV1Api(api).list_namespaced_pod, "ns")`.
    """

    def __init__(self, name: str, list_call: ListCall, deliver: Callable[[WatchEvent], None],
                 loop: asyncio.AbstractEventLoop, *, label_selector: str = "", field_selector: str = "",
                 tuning: WatchTuning = DEFAULT_TUNING) -> None:
        self.name = name
        self.list_call = list_call
        self.deliver = deliver
        self.loop = loop
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.tuning = tuning
        self._stop = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"informer-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Ask the thread to end; unblocks a watch read in progress."""
        self._stop.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):
                response.shutdown()

    async def join(self, timeout: float = 5.0) -> None:
        self.stop()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout)

    # -- thread side --

    def _emit(self, event: WatchEvent) -> None:
        if self._stop.is_set():
            return
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self.loop.call_soon_threadsafe(self.deliver, event)

    def _selectors(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.label_selector:
            out["label_selector"] = self.label_selector
        if self.field_selector:
            out["field_selector"] = self.field_selector
        return out

    def _run(self) -> None:
        backoff = self.tuning.backoff_initial
        version = ""  # "" = must (re)list
        deadline = 0.0
        while not self._stop.is_set():
            try:
                if not version or time.monotonic() >= deadline:
                    version = self._list()
                    backoff = self.tuning.backoff_initial
                    deadline = time.monotonic() + self.tuning.resync_period
                    continue
                version, events = self._watch(version, deadline - time.monotonic())
                if events:
                    backoff = self.tuning.backoff_initial
                elif time.monotonic() < deadline - 1 and not self._stop.is_set():
                    # the stream ended early with nothing in it: don't spin on a flapping server
                    self._stop.wait(self._jitter(backoff))
                    backoff = min(backoff * 2, self.tuning.backoff_max)
            except Gone:
                log.info("%s: watch history expired (410 Gone), relisting", self.name)
                version = ""
            except Exception as exc:  # noqa: BLE001 - a watch must outlive any apiserver trouble
                if self._stop.is_set():
                    break
                what = "watch" if version else "list"
                if not isinstance(exc, WatchBroken):
                    version = ""  # an API error: start again from a fresh list
                log.warning("%s: %s failed (%s), retrying in %.2fs", self.name, what, _describe(exc), backoff)
                self._stop.wait(self._jitter(backoff))
                backoff = min(backoff * 2, self.tuning.backoff_max)

    @staticmethod
    def _jitter(seconds: float) -> float:
        return seconds * random.uniform(1.0, 1.2)

    def _list(self) -> str:
        try:
            response = self.list_call(**self._selectors(), _preload_content=False,
                                      _request_timeout=self.tuning.request_timeout)
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status == 404:
                # The namespace or the CRD does not exist (yet): that is an empty collection,
                # which the consumer must hear about; keep retrying in case it appears.
                self._emit(WatchEvent("SYNC"))
            raise
        data = json.loads(response.data)
        items = tuple(data.get("items") or ())
        self._emit(WatchEvent("SYNC", items=items))
        # "0" (watch from any state) if a server leaves the version out: never relist in a loop
        return str((data.get("metadata") or {}).get("resourceVersion") or "0")

    def _watch(self, version: str, duration: float) -> tuple[str, int]:
        """One watch request; returns (last version seen, events received)."""
        from kubernetes.watch.watch import iter_resp_lines

        seconds = max(1, int(duration))
        try:
            response = self.list_call(
                **self._selectors(), watch=True, resource_version=version, timeout_seconds=seconds,
                allow_watch_bookmarks=True, _preload_content=False,
                _request_timeout=(self.tuning.request_timeout, seconds + self.tuning.request_timeout),
            )
        except HTTPError as exc:  # apiserver unreachable: resume from the same version later
            raise WatchBroken(exc) from exc
        except Exception as exc:
            if getattr(exc, "status", None) == 410:
                raise Gone() from None
            raise
        self._response = response
        events = 0
        try:
            if self._stop.is_set():
                return version, events
            for line in iter_resp_lines(response):
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        raise Gone()
                    raise ApiError(int(code or 0), str(obj.get("message", "watch error")))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    events += 1
                    self._emit(WatchEvent(kind, obj=obj))
            return version, events
        except HTTPError as exc:
            if self._stop.is_set():
                return version, events
            if events:  # dropped mid-stream after progress: resume from where we are, at once
                log.info("%s: watch connection lost (%s), resuming", self.name, _describe(exc))
                return version, events
            raise WatchBroken(exc) from exc
        finally:
            self._response = None
            with contextlib.suppress(Exception):
                # Close, not just release: a watch cut short still has stream bytes in flight, and
                # a pooled connection carrying them would hand them to the next request as its answer.
                response.close()
                response.release_conn()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, WatchBroken) and exc.__cause__ is not None:
        exc = exc.__cause__
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status:
        return f"HTTP {status} {reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"
