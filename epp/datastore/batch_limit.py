"""A pod's batch limit (vLLM's `max_num_seqs`), as its scrapes reveal it.

vLLM does not export `max_num_seqs`, and a wrong guess is costly: a pod running all of its few
slots (long generations on `--max-num-seqs 8`) makes a new request wait for one of them to end,
seconds, while the default of 256 says "room". The scrapes show it, though: requests waiting
while the KV cache has room and no prompt big enough to fill a step's token budget is being
prefilled can only wait for a slot, so the number running then is the limit. Seen `CONFIRM`
times at the most requests the pod has ever run, it is taken as the limit (a pod restarted with
more slots shows more running, and the count starts again).
"""

from __future__ import annotations

from dataclasses import dataclass

CONFIRM = 3  # scrapes that must agree
_KV_ROOM = 0.9  # below this KV use, a waiting request is not waiting for blocks


@dataclass(slots=True)
class BatchLimit:
    most_running: int = 0  # the most requests the pod was ever seen running at once
    confirmed: int = 0  # scrapes that showed requests waiting for a slot at `most_running`

    def observe(self, running: int, waiting: int, kv_usage: float, prefill_backlog: int,
                token_budget: int) -> None:
        """One valid scrape; `prefill_backlog`: the ledger's queued prefill (tokens) at that moment."""
        if running > self.most_running:
            self.most_running = running
            self.confirmed = 0
        if (running > 0 and running == self.most_running and waiting > 0 and kv_usage < _KV_ROOM
                and prefill_backlog < token_budget // 2):
            self.confirmed += 1

    def limit(self, configured: int) -> int:
        """The pod's batch limit: the one its scrapes showed, else `configured` (never below what
        it was seen running)."""
        if self.confirmed >= CONFIRM:
            return self.most_running
        return max(configured, self.most_running)
