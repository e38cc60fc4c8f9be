"""KV-cache events published like vLLM 0.32's `--kv-events-config` (ZMQ PUB + replay ROUTER).

`config`: the flag's JSON and per-pod endpoints/topic; `publisher`: the ZMQ publisher thread.
"""

from epp.sim.kv_publisher.config import KVEventsConfig, PodPublisherSettings, is_bind_endpoint, offset_endpoint
from epp.sim.kv_publisher.publisher import END_SEQ, ZmqEventPublisher

__all__ = ["END_SEQ", "KVEventsConfig", "PodPublisherSettings", "ZmqEventPublisher", "is_bind_endpoint",
           "offset_endpoint"]
