"""`destination-endpoint-served-verifier` (conformance only): echo the endpoint the proxy says served.

The gateway reports `envoy.lb / x-gateway-destination-endpoint-served`; the conformance suite reads
it back from the `x-conformance-test-served-endpoint` response header.
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.scheduling.framework import ResponseReceived

RESULT_HEADER = "x-conformance-test-served-endpoint"
MISSING = "fail: missing destination endpoint served metadata"


class DestinationEndpointServedVerifier(ResponseReceived):
    type = "destination-endpoint-served-verifier"

    def response_received(self, request: InferenceRequest, served: str) -> dict[str, str]:
        return {RESULT_HEADER: served or MISSING}
