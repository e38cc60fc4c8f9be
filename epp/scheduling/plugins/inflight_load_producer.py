"""`inflight-load-producer`: accepted for GIE config compatibility; it has nothing to do here.

In the reference this plugin counts in-flight requests and tokens per endpoint for the load
scorers. This EPP always does that in request control, at pick time (`Endpoint.inflight_requests`,
`Endpoint.inflight_tokens`), whether or not the plugin is configured.
"""

from __future__ import annotations

from epp.scheduling.framework import Plugin


class InflightLoadProducer(Plugin):
    type = "inflight-load-producer"
