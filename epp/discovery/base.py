"""How endpoints get into the datastore. Kubernetes and static files implement the same shape."""

from __future__ import annotations

from abc import ABC, abstractmethod

from epp.datastore import Datastore


class Discovery(ABC):
    """Keeps `datastore`'s endpoints (and pool info) in step with some source of truth.

    `start` returns once the first listing is in the datastore (or raises); updates continue in
    the background until `stop`. It must set `datastore.synced` after the first full listing.
    """

    @abstractmethod
    async def start(self, datastore: Datastore) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...
