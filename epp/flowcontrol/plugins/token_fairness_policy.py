"""`token-fairness-policy` (ours): flows share a band by the tokens they actually use.

Round robin counts requests, but one request can be ten tokens or ten thousand: a user of long
generations would hold the engines many times longer than a user of short ones at the same
request rate. This policy keeps a *service counter* per flow, in weighted tokens
(`inputTokenWeight` × prompt + `outputTokenWeight` × completion; output costs more because each
output token is a decode step), and always dispatches from the waiting flow with the least
service — virtual-token-counter / start-time fair queueing.

- **Estimate, then correct.** At dispatch a flow is charged an estimate: its prompt estimate plus
  the flow's recent mean completion length (`defaultOutputTokens` until one is seen), capped by
  the request's `max_tokens`. When the request ends, the charge is corrected to the `usage` the
  model server reported (no usage, e.g. a cancelled stream: the estimate stands). So a burst is
  spread by the estimate before any response is back, and the counters converge on real use.
- **No banking of idle time.** A flow that starts queueing again is lifted to the band's virtual
  time (the service level of the last dispatch), so staying away earns no credit to starve the
  others later; a flow that used more than its share keeps its debt.
- **Cost.** A heap of waiting flows keyed by (service, head arrival): O(log flows) per enqueue,
  dispatch, removal and completion. Counters of idle flows at or below the virtual time carry no
  information and are dropped.

Parameters: `inputTokenWeight` (1.0), `outputTokenWeight` (2.0), `defaultOutputTokens` (256).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epp.api.response import Usage
from epp.params import Params
from epp.flowcontrol.item import QueueItem
from epp.flowcontrol.item_queue import ItemQueue
from epp.flowcontrol.policy import FairnessPolicy, FairnessQueue, OrderingPolicy

if TYPE_CHECKING:
    from epp.plugin import PluginContext

_EWMA = 0.2  # weight of the newest completion length in a flow's mean
_HEAP_SLACK = 64


@dataclass(slots=True)
class _Flow:
    queue: ItemQueue
    service: float = 0.0
    mean_output: float = 0.0
    outputs_seen: int = 0
    key: tuple[float, int] | None = None  # its live heap key; None while not waiting
    version: int = 0
    idle: bool = False  # nothing queued or in flight (told by the controller)


class _TokenFairQueue(FairnessQueue):
    def __init__(self, policy: TokenFairnessPolicy, ordering: OrderingPolicy) -> None:
        self._policy = policy
        self._ordering = ordering
        self._flows: dict[str, _Flow] = {}
        self._heap: list[tuple[float, int, int, str]] = []  # (service, head seq, version, flow)
        self._waiting = 0  # flows with a live heap key
        self._count = 0
        self.vtime = 0.0
        self._sweep_at = _HEAP_SLACK

    # -- per-flow state --

    def service(self, flow_id: str) -> float:
        flow = self._flows.get(flow_id)
        return max(flow.service, self.vtime) if flow is not None else self.vtime

    def _flow(self, flow_id: str) -> _Flow:
        flow = self._flows.get(flow_id)
        if flow is None:
            flow = self._flows[flow_id] = _Flow(self._ordering.new_queue(), service=self.vtime)
        return flow

    def _refresh(self, flow_id: str, flow: _Flow) -> None:
        """Re-key a flow after its service or head changed (a new heap entry; old ones go stale)."""
        head = flow.queue.peek()
        key = None if head is None else (flow.service, head.seq)
        if key == flow.key:
            return
        if flow.key is None:
            self._waiting += 1
        elif key is None:
            self._waiting -= 1
        flow.key = key
        flow.version += 1
        if key is not None:
            heapq.heappush(self._heap, (key[0], key[1], flow.version, flow_id))
            if len(self._heap) > 2 * self._waiting + _HEAP_SLACK:
                self._compact()

    def _compact(self) -> None:
        self._heap = [(f.key[0], f.key[1], f.version, fid) for fid, f in self._flows.items() if f.key is not None]
        heapq.heapify(self._heap)

    def _top(self) -> tuple[str, _Flow] | None:
        heap = self._heap
        while heap:
            _, _, version, flow_id = heap[0]
            flow = self._flows.get(flow_id)
            if flow is not None and flow.version == version and flow.key is not None:
                return flow_id, flow
            heapq.heappop(heap)
        return None

    # -- FairnessQueue --

    def push(self, item: QueueItem) -> None:
        flow = self._flow(item.flow_id)
        if not flow.queue:
            flow.service = max(flow.service, self.vtime)  # no credit for time away
        flow.idle = False
        flow.queue.push(item)
        self._count += 1
        self._refresh(item.flow_id, flow)

    def remove(self, item: QueueItem) -> bool:
        flow = self._flows.get(item.flow_id)
        if flow is None or not flow.queue.remove(item):
            return False
        self._count -= 1
        self._refresh(item.flow_id, flow)
        return True

    def peek(self) -> QueueItem | None:
        top = self._top()
        return top[1].queue.peek() if top is not None else None

    def heads(self, limit: int) -> list[QueueItem]:
        """The heads of the `limit` least-served waiting flows: their heap entries are popped
        (stale ones dropped) and pushed back, O(limit × log flows)."""
        heap = self._heap
        taken: list[tuple[float, int, int, str]] = []
        out: list[QueueItem] = []
        while heap and len(out) < limit:
            entry = heapq.heappop(heap)
            flow = self._flows.get(entry[3])
            if flow is None or flow.version != entry[2] or flow.key is None:
                continue
            taken.append(entry)
            out.append(flow.queue.peek())  # type: ignore[arg-type]
        for entry in taken:
            heapq.heappush(heap, entry)
        return out

    def pop(self) -> QueueItem:
        top = self._top()
        assert top is not None, "pop from an empty band"
        return self.pop_flow(top[0])

    def pop_flow(self, flow_id: str) -> QueueItem:
        flow = self._flows[flow_id]
        item = flow.queue.pop()
        self._count -= 1
        self.vtime = max(self.vtime, flow.service)
        item.charged = self._policy.estimate(item, flow.mean_output if flow.outputs_seen else None)
        flow.service += item.charged
        self._refresh(flow_id, flow)
        return item

    def __len__(self) -> int:
        return self._count

    def completed(self, item: QueueItem, usage: Usage | None) -> None:
        if usage is None:
            return
        flow = self._flow(item.flow_id)
        actual = self._policy.cost(usage.prompt_tokens, usage.completion_tokens)
        flow.service += actual - item.charged
        item.charged = actual
        if flow.outputs_seen:
            flow.mean_output += _EWMA * (usage.completion_tokens - flow.mean_output)
        else:
            flow.mean_output = float(usage.completion_tokens)
        flow.outputs_seen += 1
        self._refresh(item.flow_id, flow)

    def refund(self, item: QueueItem) -> None:
        flow = self._flows.get(item.flow_id)
        if flow is not None:
            flow.service -= item.charged
            self._refresh(item.flow_id, flow)
        item.charged = 0.0

    def flow_idle(self, flow_id: str) -> None:
        flow = self._flows.get(flow_id)
        if flow is None or flow.queue:
            return
        if flow.service <= self.vtime and flow.outputs_seen == 0:
            del self._flows[flow_id]  # lifted to vtime on return anyway: nothing to remember
            return
        flow.idle = True
        if len(self._flows) > self._sweep_at:
            self._sweep()

    def _sweep(self) -> None:
        """Forget idle flows the virtual time has caught up with (amortised O(1) per call)."""
        self._flows = {fid: f for fid, f in self._flows.items() if not (f.idle and f.service <= self.vtime)}
        self._sweep_at = 2 * len(self._flows) + _HEAP_SLACK


class TokenFairnessPolicy(FairnessPolicy):
    type = "token-fairness-policy"

    def __init__(self, name: str = "", *, input_token_weight: float = 1.0, output_token_weight: float = 2.0,
                 default_output_tokens: int = 256) -> None:
        super().__init__(name)
        if input_token_weight < 0 or output_token_weight < 0 or input_token_weight + output_token_weight <= 0:
            raise ValueError("token weights must be >= 0 and not both 0")
        if default_output_tokens < 0:
            raise ValueError("defaultOutputTokens must be >= 0")
        self.input_token_weight = input_token_weight
        self.output_token_weight = output_token_weight
        self.default_output_tokens = default_output_tokens

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> TokenFairnessPolicy:
        w_in = params.float("inputTokenWeight", 1.0, min=0.0)
        w_out = params.float("outputTokenWeight", 2.0, min=0.0)
        default_out = params.int("defaultOutputTokens", 256, min=0)
        params.done()
        if w_in + w_out <= 0:
            raise params.error("outputTokenWeight", "inputTokenWeight and outputTokenWeight cannot both be 0")
        return cls(name, input_token_weight=w_in, output_token_weight=w_out, default_output_tokens=default_out)

    def cost(self, prompt_tokens: float, completion_tokens: float) -> float:
        return self.input_token_weight * prompt_tokens + self.output_token_weight * completion_tokens

    def estimate(self, item: QueueItem, mean_output: float | None) -> float:
        """The charge at dispatch: prompt estimate + expected output (capped by max_tokens)."""
        output = self.default_output_tokens if mean_output is None else mean_output
        max_tokens = item.request.max_tokens
        if max_tokens is not None and max_tokens >= 0:
            output = min(output, max_tokens)
        return self.cost(item.request.prompt_tokens_estimate, output)

    def new_band(self, ordering: OrderingPolicy) -> FairnessQueue:
        return _TokenFairQueue(self, ordering)
