"""A pod's batch limit (vLLM's `max_num_seqs`), as its scrapes reveal it.

vLLM does not export `max_num_seqs`, and a wrong guess is costly: a pod running all of its few
slots (long generations on `--max-num-seqs 8`) makes a new request wait for one of them to end,
seconds, while the default of 256 says "room". The scrapes show it, though: requests waiting
while the KV cache has room and no prompt big enough to fill a step's token budget is being
prefilled can only wait for a slot, so the number running then is the limit. Seen in `CONFIRM`
scrapes in a row at the most requests the pod has ever run, each after the engine stepped (its
KV use changed since the scrape before: arrivals alone move the queue), it is taken as the limit (a pod
restarted with more slots shows more running, and the count starts again). In a row and moving,
because a busy pod below its limit shows requests waiting too: the ones that arrived since its
last step, admitted at the next, and a slow step (an A100 prefilling) outlasts several scrapes
of one unchanged state. And more waiting than the requests the EPP sent the pod within its last
two steps (`recent`, still without a first byte): those may be in that race too, and a pod under
heavy traffic shows one or two so at almost every scrape. Counted as waiting for a slot, three
scrapes in a row at its most running made a 256-slot pod's limit 62; every pod of the pool was
then held to it (the limit the others showed) and ranked short of slots at 62 (`prefix-heavy`
on 16 pods: a slot wait on 8 pods at thousands of picks). One scrape that is not at the limit
with requests waiting starts again; a limit once taken is kept until the pod runs more.
"""

from __future__ import annotations

from dataclasses import dataclass

CONFIRM = 3  # scrapes that must agree, in a row, each of a new engine state
_KV_ROOM = 0.9  # below this KV use, a waiting request is not waiting for blocks


@dataclass(slots=True)
class BatchLimit:
    most_running: int = 0  # the most requests the pod was ever seen running at once
    confirmed: int = 0  # scrapes in a row that showed requests waiting for a slot at `most_running`
    taken: bool = False  # `most_running` is the limit
    last: tuple[int, float] = (0, 0.0)  # the previous scrape's running and KV use

    def observe(self, running: int, waiting: int, kv_usage: float, prefill_backlog: int,
                token_budget: int, recent: int = 0) -> None:
        """One valid scrape; `prefill_backlog`: the ledger's queued prefill (tokens) at that moment;
        `recent`: the EPP's requests to the pod sent within its last two steps, still without a
        first byte (they may be waiting for the next step, not for a slot)."""
        if running > self.most_running:
            self.most_running = running
            self.confirmed = 0
            self.taken = False
        state = (running, kv_usage)
        if self.taken or state == self.last:
            return  # known, or the engine has not stepped since the last scrape
        self.last = state
        if (running > 0 and running == self.most_running and waiting > recent and kv_usage < _KV_ROOM
                and prefill_backlog < token_budget // 2):
            self.confirmed += 1
            self.taken = self.confirmed >= CONFIRM
        else:
            self.confirmed = 0  # not in a row: a passing queue is no limit

    def limit(self, assumed: int, configured: int = 0) -> int:
        """The pod's batch limit: the one its scrapes showed, else `assumed` (never below what it
        was seen running). `assumed` may be what other pods of the pool showed; a pod seen running
        more than that runs another configuration (a pool mid-rollout, a group given other
        engine flags), and is held to `configured` (the default) instead, when given: held to
        the most it ran, each pod of 256 slots beside pods of 32 looked full at every count it
        reached, and the long generations of `head-of-line` waited for slots on the small pods
        (TTFT p90 1,023 against 267 ms, BENCHMARKS.md)."""
        if self.taken:
            return self.most_running
        if configured and self.most_running > assumed:
            return max(configured, self.most_running)
        return max(assumed, self.most_running)
