"""Token slices in the virtual-time cluster (experimental): a long generation served as a chain of
requests of at most S output tokens each, every one routed afresh.

The idea (the token-slice talk): a generation whose length nobody knows in advance holds a batch
slot until it ends, and short requests queue behind a few long ones. Cut it into slices of S
tokens — each slice a request with `max_tokens = S` whose prompt is the text so far — and the
router (with its flow control) decides again between slices, so the long request gives its slot
back every S tokens and takes its turn like everyone else. A sidecar would stitch the slices into
one response for the client. The price is a context switch per slice: the slice's prompt
(everything so far) must be prefilled again wherever its KV blocks are not cached — on another
pod, or on the same pod after they were evicted — and the gap between slices is an inter-token
gap the client sees.

`SlicedCluster` is the `Cluster` with that behaviour; everything else (engines, scrapes, the EPP
and its flow control, the report) is unchanged, so a run with slices compares figure by figure
with one without. Each client request stays one `Job` in the results (its first token is slice
0's, its end the last slice's); the slices are jobs of their own only on the way through the
router and the pods. A slice's engine request carries the block hashes of everything before it
(prompt and the tokens generated so far, as vLLM would hash the same token ids sent back as a
prompt), so a slice that lands where its predecessor ran hits the cached blocks and prefills only
the last partial block; elsewhere it pays the full re-prefill, counted in `SliceStats`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.sim.cluster.cluster import Cluster, RunResult
from epp.sim.cluster.routers import Router
from epp.sim.cluster.traffic import Job
from epp.sim.cluster.workload import Workload
from epp.sim.generation import token_ids, token_text
from epp.sim.kv_cache import prepare_block_hashes
from epp.sim.pool import PodGroup
from epp.sim.request import FINISH_ABORT, Request

SLICE_ID_BASE = 1 << 40  # slice request ids start here, far above any client request id


@dataclass(slots=True)
class SliceStats:
    """What slicing cost in one run."""

    slice_tokens: int
    requests_sliced: int = 0  # client requests served in more than one slice
    slices: int = 0  # slice requests sent (first slices included)
    moved: int = 0  # continuations that went to another pod than the slice before
    reprefill_tokens: int = 0  # prompt tokens continuations computed again (not cache hits)
    continuation_prompt_tokens: int = 0  # prompt tokens of all continuations (what could have hit)
    gaps: list[float] = field(default_factory=list)  # last token of a slice -> first of the next, seconds

    @property
    def reprefill_share(self) -> float:
        return self.reprefill_tokens / self.continuation_prompt_tokens if self.continuation_prompt_tokens else 0.0


@dataclass(slots=True, eq=False)
class _Chain:
    """A client request in flight as slices."""

    parent: Job
    remaining: int  # output tokens still to generate
    text: str  # the prompt so far, as the router sees it
    first: Request | None = None  # slice 0's engine request (chat follow-ups read its salt)
    last_pod: int = -1
    last_token: float = -1.0


class SlicedCluster(Cluster):
    """A `Cluster` whose requests longer than `slice_tokens` output tokens run as slices."""

    def __init__(self, workload: Workload, router: Router, *, pods: int | str | Sequence[PodGroup],
                 slice_tokens: int, **kwargs: object) -> None:
        if slice_tokens < 1:
            raise ValueError("slice_tokens must be >= 1")
        super().__init__(workload, router, pods=pods, **kwargs)  # type: ignore[arg-type]
        self.slice_tokens = slice_tokens
        self.slice_stats = SliceStats(slice_tokens)
        self._chains: dict[Job, _Chain] = {}  # slice job -> its chain
        self._slice_ids = itertools.count(SLICE_ID_BASE)
        self._salts = random.Random(f"{self.seed}:slices")

    # -- arrivals: a client request becomes its first slice --

    def _arrive(self, job: Job, owed: bool = False) -> None:
        if job.output_tokens <= self.slice_tokens:
            super()._arrive(job, owed)
            return
        self.jobs.append(job)
        if not owed:
            self._open += 1
        chain = _Chain(parent=job, remaining=job.output_tokens, text=job.prompt)
        job.prompt = ""
        self.slice_stats.requests_sliced += 1
        assert job.prompt_ids is not None
        request = self.factory.from_token_ids(job.prompt_ids, max_tokens=self.slice_tokens, ignore_eos=True,
                                              lora=job.lora, arrival_time=job.arrival,
                                              request_id=str(next(self._slice_ids)))
        job.prompt_ids = None
        chain.first = request
        prepare_block_hashes(request, self.sim_config.engine.block_size)  # as `Cluster._arrive` does
        self._send(chain, request)

    def _send(self, chain: _Chain, request: Request) -> None:
        """Route one slice (a job of its own for the router) of `chain`."""
        parent = chain.parent
        output = min(self.slice_tokens, chain.remaining)
        request.max_tokens = request.output_len = output
        piece = Job(id=int(request.request_id), cls=parent.cls, tenant=parent.tenant, arrival=self.loop.time(),
                    prompt=chain.text, prompt_tokens=request.prompt_len, output_tokens=output, max_tokens=output,
                    lora=parent.lora)
        piece.request = request
        request.user_data = piece
        self._chains[piece] = chain
        self.slice_stats.slices += 1
        task = self.loop.create_task(self._route(piece))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- completions: the next slice, or the end of the client request --

    def _finished(self, req: Request) -> None:
        piece = req.user_data
        chain = self._chains.get(piece) if isinstance(piece, Job) else None
        if chain is None:
            super()._finished(req)
            return
        if req.finish_reason == FINISH_ABORT:
            self._end(piece, "aborted", routed=True)
            return
        assert isinstance(piece, Job)
        parent = chain.parent
        stats = self.slice_stats
        if parent.first_token < 0:
            parent.first_token = req.first_token_time
            parent.dispatch = piece.dispatch
            parent.pod = piece.pod
            parent.cached_tokens = max(0, req.num_cached_tokens)
        else:
            stats.gaps.append(req.first_token_time - chain.last_token)
            stats.continuation_prompt_tokens += req.prompt_len
            stats.reprefill_tokens += req.prompt_len - max(0, req.num_cached_tokens)
            if piece.pod != chain.last_pod:
                stats.moved += 1
        generated = req.num_output_tokens
        parent.generated += generated
        chain.remaining -= generated
        chain.last_pod = piece.pod
        chain.last_token = req.finish_time
        del self._chains[piece]
        piece.first_token, piece.finish, piece.generated = req.first_token_time, req.finish_time, generated
        piece.cached_tokens = max(0, req.num_cached_tokens)
        self.router.finished(piece)  # the EPP releases this slice, with its usage
        piece.request = None
        if chain.remaining > 0:
            self._send(chain, self._continuation(chain, req))
            return
        parent.finish = req.finish_time
        parent.request = chain.first
        self.completed += 1
        super()._end(parent, "")

    def _continuation(self, chain: _Chain, prev: Request) -> Request:
        """The next slice: its prompt is the previous slice's prompt plus what it generated (the
        text the slicer re-sends, tokenized back to exactly those ids)."""
        generated = prev.num_output_tokens
        tokenizer = self.factory.tokenizer
        chain.text += token_text(prev.salt, 0, generated, tokenizer.output_vocab)
        assert prev.prompt_token_ids is not None
        ids = prev.prompt_token_ids + token_ids(prev.salt, 0, generated, tokenizer.output_ids)
        request = self.factory.from_token_ids(ids, max_tokens=self.slice_tokens, ignore_eos=True, lora=prev.lora,
                                              arrival_time=self.loop.time(), request_id=str(next(self._slice_ids)),
                                              cache_salt=prev.cache_salt)
        prepare_block_hashes(request, self.sim_config.engine.block_size)
        return request

    def _end(self, job: Job, error: str, *, routed: bool = False) -> None:
        chain = self._chains.pop(job, None)
        if chain is None:
            super()._end(job, error, routed=routed)
            return
        # A slice failed (rejected by the router, or aborted): the client request ends with it.
        if routed:
            self.router.finished(job)
        job.request = None
        super()._end(chain.parent, error or "slice_failed")


def run_sliced(workload: Workload, router: Router, *, pods: int | str | Sequence[PodGroup], slice_tokens: int,
               **kwargs: object) -> tuple[RunResult, SliceStats]:
    """Convenience: a `SlicedCluster` run and what slicing cost."""
    cluster = SlicedCluster(workload, router, pods=pods, slice_tokens=slice_tokens, **kwargs)
    result = cluster.run()
    return result, cluster.slice_stats
