"""Every HTTP header and metadata key the EPP reads or writes, in one place.

The ext_proc stream, the request parser and the virtual-time simulator all take their names
from here, so what `epp simulate` runs can never drift from what `epp serve` runs.
"""

from __future__ import annotations

# Client (or gateway) → EPP: request control.
FAIRNESS_ID = "x-gateway-inference-fairness-id"
OBJECTIVE = "x-gateway-inference-objective"
MODEL_REWRITE = "x-gateway-model-name-rewrite"
REQUEST_ID = "x-request-id"
SLO_TTFT = "x-slo-ttft-ms"  # time-to-first-token objective, milliseconds
SLO_TPOT = "x-slo-tpot-ms"  # time-per-output-token (inter-token) objective, milliseconds (llm-d's name)
DEFAULT_FAIRNESS_ID = "default-flow"

# Where the request path is found, in order (the reference's fallbacks).
PATH_HEADERS = (":path", "x-original-path", "x-forwarded-path")

# EPP → proxy: the pick, as a header and as `envoy.lb` dynamic metadata.
DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_SERVED = "x-gateway-destination-endpoint-served"
DESTINATION_SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"

# EPP → client, with --debug-decision-header.
DEBUG_DECISION = "x-epp-decision"

# EPP → its own response observer (a second ext_proc filter in observability mode, after the
# picking one): a random token naming the request, so the observer's stream finds the pick.
OBSERVE_TOKEN = "x-epp-observe"
# ... and, beside it, how the response is reported when not by an observer stream: `access-log`
# for a non-streamed OpenAI-API response, whose usage Envoy's access log carries (a Lua filter reads
# it off the body's end; `epp.extproc.access_log`). Envoy configs that predate it ignore it and
# run the observer, which reports the response as before.
OBSERVE_VIA = "x-epp-observe-via"
VIA_ACCESS_LOG = "access-log"
# For a streamed response: the observer reports its first token, and, where the Envoy config has
# the access log (the observer's messages then carry `epp.logged`), the log its usage and end.
VIA_FIRST_TOKEN = "first-token"
