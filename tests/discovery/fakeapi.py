"""A small fake Kubernetes apiserver: real list/watch over HTTP, for the kinds the EPP uses.

There is no kube-apiserver on these machines, so discovery and leader election are tested against
this. It serves the wire shapes the official `kubernetes` client expects:

- namespaced collections for pods, inferencepools, inferenceobjectives, leases and events, with
  `labelSelector` (equality-based) and `fieldSelector` (`metadata.name`, `metadata.namespace`);
- one global, increasing `resourceVersion`; every change is kept in an event log, so a watch
  from an older version replays what it missed;
- `?watch=true` streams JSON lines over chunked HTTP, with the apiserver's selector semantics
  (an object that stops matching is sent as DELETED, one that starts matching as ADDED);
- `410 Gone` for a watch from a compacted version, either as an ERROR event (what a real
  apiserver does) or as an HTTP 410 (what some proxies and older servers do);
- get/create/update with optimistic concurrency (409 Conflict) for leases;
- API discovery (`/apis/<group>/<version>`) only for installed CRDs.

Tests drive it from their own thread: every mutator hops onto the server's loop and waits.
Fault injection: `drop_watches()`, `expire_watches()`, `compact()`, `fail_next()`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

CORE = ""
POOL_GROUP = "inference.networking.k8s.io"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"


@dataclass(frozen=True, slots=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    crd: bool = False  # served only while installed

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


KINDS: dict[str, Kind] = {
    k.plural: k
    for k in (
        Kind(CORE, "v1", "pods", "Pod"),
        Kind(CORE, "v1", "events", "Event"),
        Kind("coordination.k8s.io", "v1", "leases", "Lease"),
        Kind(POOL_GROUP, "v1", "inferencepools", "InferencePool", crd=True),
        Kind(OBJECTIVE_GROUP, "v1alpha2", "inferenceobjectives", "InferenceObjective", crd=True),
    )
}


@dataclass(slots=True)
class Change:
    rv: int
    plural: str
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]


def parse_label_selector(text: str) -> list[tuple[str, str, str]]:
    """`a=b,c!=d,e==f` → [(key, op, value)]; the equality-based subset the EPP sends."""
    out: list[tuple[str, str, str]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        for op in ("!=", "==", "="):
            if op in term:
                key, _, value = term.partition(op)
                out.append((key.strip(), "!=" if op == "!=" else "=", value.strip()))
                break
        else:
            raise ValueError(f"unsupported selector term {term!r}")
    return out


def parse_field_selector(text: str) -> list[tuple[str, str]]:
    out = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = term.partition("=")
        if not sep or key not in ("metadata.name", "metadata.namespace"):
            raise ValueError(f"field label not supported: {key}")
        out.append((key, value.lstrip("=")))
    return out


def _matches(obj: dict[str, Any] | None, labels: list[tuple[str, str, str]], fields: list[tuple[str, str]]) -> bool:
    if obj is None:
        return False
    meta = obj.get("metadata", {})
    have = meta.get("labels") or {}
    for key, op, value in labels:
        if (have.get(key) == value) != (op == "="):
            return False
    return all(meta.get(key.split(".", 1)[1], "") == value for key, value in fields)


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class FakeApiServer:
    """Thread-hosted aiohttp apiserver. Use as a context manager or call start()/stop()."""

    def __init__(self, *, gone_as_http: bool = False) -> None:
        self.gone_as_http = gone_as_http  # 410 as an HTTP status instead of an ERROR watch event
        self.installed: set[str] = {"inferencepools", "inferenceobjectives"}
        self.requests: list[Request] = []
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._log: list[Change] = []
        self._rv = 100
        self._compacted = 0  # watches from a version below this get 410 Gone
        self._failures: list[tuple[Callable[[Request], bool], int]] = []
        self._watches: set[asyncio.Queue[Change | str | None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle --

    def start(self) -> FakeApiServer:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            loop.run_until_complete(self._serve())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-apiserver", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake apiserver did not start")
        return self

    def stop(self) -> None:
        if self._loop and self._thread:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._thread = None

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, namespace: str = "default") -> str:
        """A kubeconfig (YAML is a superset of this JSON) pointing at this server."""
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": namespace}}],
        })

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/apis/{group}/{version}", self._discovery)
        app.router.add_route("*", "/api/{version}/namespaces/{ns}/{plural}", self._collection)
        app.router.add_route("*", "/api/{version}/namespaces/{ns}/{plural}/{name}", self._item)
        app.router.add_route("*", "/apis/{group}/{version}/namespaces/{ns}/{plural}", self._collection)
        app.router.add_route("*", "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}", self._item)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _shutdown(self) -> None:
        for queue in list(self._watches):
            queue.put_nowait(None)
        if self._runner:
            await self._runner.cleanup()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the server loop (all state lives there) and return its result."""
        assert self._loop is not None

        async def wrapper() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result(10)

    # -- test-side API (thread-safe) --

    def apply(self, obj: dict[str, Any], *, silent: bool = False) -> dict[str, Any]:
        """Create or replace an object (like `kubectl apply` without merging).

        `silent` changes the object without telling any watch (a lost event), which only a
        relist can reveal.
        """
        return self._call(lambda: self._apply(copy.deepcopy(obj), silent=silent))

    def delete(self, plural: str, name: str, namespace: str = "default") -> None:
        self._call(lambda: self._delete(plural, namespace, name))

    def get(self, plural: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self._call(lambda: copy.deepcopy(self._objects.get((plural, namespace, name))))

    def drop_watches(self) -> int:
        """Close every open watch stream abruptly, as a load balancer or apiserver restart would."""
        return self._call(lambda: self._end_watches("drop"))

    def expire_watches(self) -> int:
        """Compact history and end every watch with an ERROR 410 event, as etcd compaction does."""

        def run() -> int:
            self._compacted = self._rv + 1
            return self._end_watches("gone")

        return self._call(run)

    def compact(self) -> None:
        """Forget history: a watch from any version seen so far gets 410 Gone."""

        def run() -> None:
            self._compacted = self._rv + 1

        self._call(run)

    def fail_next(self, count: int, match: Callable[[Request], bool] = lambda r: True) -> None:
        """Answer the next `count` matching requests with 500."""
        self._call(lambda: self._failures.append((match, count)))

    def heal(self) -> None:
        """Cancel injected failures that have not fired yet."""
        self._call(self._failures.clear)

    def uninstall(self, plural: str) -> None:
        self._call(lambda: self.installed.discard(plural))

    def open_watches(self) -> int:
        return self._call(lambda: len(self._watches))

    def count(self, plural: str, *, watch: bool | None = None, method: str = "GET") -> int:
        """How many requests hit a collection (lists when watch=False, watches when True)."""

        def run() -> int:
            n = 0
            for r in self.requests:
                if r.method != method or not r.path.endswith("/" + plural):
                    continue
                is_watch = r.query.get("watch") in ("true", "1")
                if watch is None or watch == is_watch:
                    n += 1
            return n

        return self._call(run)

    # -- state changes (on the loop) --

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _record(self, plural: str, type_: str, obj: dict[str, Any], old: dict[str, Any] | None,
                silent: bool = False) -> None:
        if silent:
            return
        change = Change(self._rv, plural, type_, copy.deepcopy(obj), old)
        self._log.append(change)
        for queue in list(self._watches):
            queue.put_nowait(change)

    def _apply(self, obj: dict[str, Any], silent: bool = False) -> dict[str, Any]:
        kind = self._kind_of(obj)
        meta = obj.setdefault("metadata", {})
        ns = meta.setdefault("namespace", "default")
        key = (kind.plural, ns, meta["name"])
        old = self._objects.get(key)
        obj["apiVersion"] = kind.group_version
        obj["kind"] = kind.kind
        meta["resourceVersion"] = str(self._next_rv())
        meta.setdefault("uid", f"uid-{kind.plural}-{ns}-{meta['name']}")
        if old is not None:
            meta["creationTimestamp"] = old["metadata"].get("creationTimestamp")
        meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        self._objects[key] = obj
        self._record(kind.plural, "MODIFIED" if old else "ADDED", obj, old, silent)
        return copy.deepcopy(obj)

    def _delete(self, plural: str, ns: str, name: str) -> dict[str, Any] | None:
        obj = self._objects.pop((plural, ns, name), None)
        if obj is None:
            return None
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self._record(plural, "DELETED", obj, obj)
        return obj

    def _end_watches(self, how: str) -> int:
        n = len(self._watches)
        for queue in list(self._watches):
            queue.put_nowait(how)
        return n

    @staticmethod
    def _kind_of(obj: dict[str, Any]) -> Kind:
        for kind in KINDS.values():
            if kind.kind == obj.get("kind"):
                return kind
        raise ValueError(f"fake apiserver does not serve kind {obj.get('kind')!r}")

    # -- HTTP --

    def _intercept(self, request: web.Request) -> web.Response | None:
        req = Request(request.method, request.path, dict(request.query))
        self.requests.append(req)
        for i, (match, count) in enumerate(self._failures):
            if count > 0 and match(req):
                self._failures[i] = (match, count - 1)
                return web.json_response(status(500, "InternalError", "injected failure"), status=500)
        return None

    def _resolve(self, request: web.Request) -> Kind | web.Response:
        info = request.match_info
        kind = KINDS.get(info["plural"])
        group = info.get("group", CORE)
        if kind is None or kind.group != group or kind.version != info["version"] or (
            kind.crd and kind.plural not in self.installed
        ):
            return web.json_response(status(404, "NotFound", "the server could not find the requested resource"),
                                     status=404)
        return kind

    async def _discovery(self, request: web.Request) -> web.Response:
        if (failed := self._intercept(request)) is not None:
            return failed
        group, version = request.match_info["group"], request.match_info["version"]
        resources = [
            {"name": k.plural, "singularName": k.kind.lower(), "namespaced": True, "kind": k.kind,
             "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}
            for k in KINDS.values()
            if k.group == group and k.version == version and (not k.crd or k.plural in self.installed)
        ]
        if not resources:
            return web.json_response(status(404, "NotFound", "the server could not find the requested resource"),
                                     status=404)
        return web.json_response({"kind": "APIResourceList", "apiVersion": "v1",
                                  "groupVersion": f"{group}/{version}", "resources": resources})

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        if (failed := self._intercept(request)) is not None:
            return failed
        kind = self._resolve(request)
        if isinstance(kind, web.Response):
            return kind
        ns = request.match_info["ns"]
        if request.method == "POST":
            body = await request.json()
            body.setdefault("metadata", {})["namespace"] = ns
            body["kind"] = kind.kind
            if (kind.plural, ns, body["metadata"].get("name")) in self._objects:
                return web.json_response(status(409, "AlreadyExists", f"{kind.plural} already exists"), status=409)
            return web.json_response(self._apply(body), status=201)
        if request.method != "GET":
            return web.json_response(status(405, "MethodNotAllowed", "method not allowed"), status=405)
        try:
            labels = parse_label_selector(request.query.get("labelSelector", ""))
            fields = parse_field_selector(request.query.get("fieldSelector", ""))
        except ValueError as exc:
            return web.json_response(status(400, "BadRequest", str(exc)), status=400)
        fields.append(("metadata.namespace", ns))
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, kind, labels, fields)
        items = [copy.deepcopy(o) for (plural, _, _), o in sorted(self._objects.items())
                 if plural == kind.plural and _matches(o, labels, fields)]
        return web.json_response({"kind": f"{kind.kind}List", "apiVersion": kind.group_version,
                                  "metadata": {"resourceVersion": str(self._rv)}, "items": items})

    async def _item(self, request: web.Request) -> web.Response:
        if (failed := self._intercept(request)) is not None:
            return failed
        kind = self._resolve(request)
        if isinstance(kind, web.Response):
            return kind
        ns, name = request.match_info["ns"], request.match_info["name"]
        key = (kind.plural, ns, name)
        current = self._objects.get(key)
        if request.method == "GET":
            if current is None:
                return web.json_response(status(404, "NotFound", f'{kind.plural} "{name}" not found'), status=404)
            return web.json_response(current)
        if request.method == "PUT":
            body = await request.json()
            if current is None:
                return web.json_response(status(404, "NotFound", f'{kind.plural} "{name}" not found'), status=404)
            sent = (body.get("metadata") or {}).get("resourceVersion")
            if sent and sent != current["metadata"]["resourceVersion"]:
                return web.json_response(status(409, "Conflict", "the object has been modified"), status=409)
            body.setdefault("metadata", {}).update(name=name, namespace=ns)
            body["kind"] = kind.kind
            return web.json_response(self._apply(body))
        if request.method == "DELETE":
            gone = self._delete(kind.plural, ns, name)
            if gone is None:
                return web.json_response(status(404, "NotFound", f'{kind.plural} "{name}" not found'), status=404)
            return web.json_response(gone)
        return web.json_response(status(405, "MethodNotAllowed", "method not allowed"), status=405)

    async def _watch(self, request: web.Request, kind: Kind, labels: list[tuple[str, str, str]],
                     fields: list[tuple[str, str]]) -> web.StreamResponse:
        since_text = request.query.get("resourceVersion", "")
        since = int(since_text) if since_text.isdigit() else 0
        expired = since and since < self._compacted
        if expired and self.gone_as_http:
            return web.json_response(status(410, "Expired", "too old resource version"), status=410)
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(type_: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": type_, "object": obj}).encode() + b"\n")

        if expired:
            await send("ERROR", status(410, "Expired", f"too old resource version: {since} ({self._compacted})"))
            return response
        queue: asyncio.Queue[Change | str | None] = asyncio.Queue()
        if since:
            backlog: Iterable[Change] = [c for c in self._log if c.rv > since]
        else:  # no version: synthetic ADDED for the current state, as the apiserver does
            backlog = [Change(self._rv, p, "ADDED", o, None) for (p, _, _), o in sorted(self._objects.items())]
        for change in backlog:
            queue.put_nowait(change)
        self._watches.add(queue)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    break
                if item is None:
                    break
                if item == "drop":
                    request.transport.close() if request.transport else None  # abrupt: no final chunk
                    break
                if item == "gone":
                    await send("ERROR", status(410, "Expired", "too old resource version"))
                    break
                assert isinstance(item, Change)
                if item.plural != kind.plural:
                    continue
                out = self._translate(item, labels, fields)
                if out:
                    await send(out, item.obj)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watches.discard(queue)
        return response

    @staticmethod
    def _translate(change: Change, labels: list[tuple[str, str, str]], fields: list[tuple[str, str]]) -> str:
        """The event type a selector-filtered watch sees for this change ("" = nothing)."""
        now = _matches(change.obj, labels, fields)
        before = _matches(change.old, labels, fields)
        if change.type == "ADDED":
            return "ADDED" if now else ""
        if change.type == "DELETED":
            return "DELETED" if before else ""
        if now and before:
            return "MODIFIED"
        if now:
            return "ADDED"
        return "DELETED" if before else ""


# -- object builders --


def pod(name: str, ip: str, labels: dict[str, str] | None = None, *, ready: bool = True, namespace: str = "default",
        annotations: dict[str, str] | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    if annotations:
        meta["annotations"] = dict(annotations)
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:10Z"
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [
                {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        },
    }


def inference_pool(name: str, match_labels: dict[str, str], ports: Iterable[int] = (8000,), *,
                   namespace: str = "default", app_protocol: str = "", epp: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"matchLabels": dict(match_labels)},
                            "targetPorts": [{"number": p} for p in ports]}
    if app_protocol:
        spec["appProtocol"] = app_protocol
    if epp:
        spec["endpointPickerRef"] = {"name": epp, "port": {"number": 9002}, "failureMode": "FailOpen"}
    return {"apiVersion": f"{POOL_GROUP}/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def inference_objective(name: str, pool: str, priority: int | None = None, *,
                        namespace: str = "default") -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": f"{OBJECTIVE_GROUP}/v1alpha2", "kind": "InferenceObjective",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}

