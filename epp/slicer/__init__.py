"""`epp slicer` (experimental): serve long generations as token slices behind one ordinary response.

An HTTP proxy in front of the gateway (or a model server). A completion or chat completion that
may generate more than S tokens is sent upstream as a chain of requests of at most S tokens, each
continuing the text so far, so the gateway's EPP routes (and flow control queues) every slice
afresh and a long generation gives its batch slot back every S tokens (see
`epp.sim.cluster.slices` for the measurements that justified building it). The client sees one
OpenAI response — the same JSON, or the same server-sent events, an unsliced request gets — with
the text of all slices, the last slice's finish reason and the usage summed over slices.

- `plan.py`: which requests are sliced (the rest pass through untouched) and each slice's body.
- `stitch.py`: the slices' responses and events into one response (pure, no I/O).
- `server.py`: the aiohttp proxy; a client that goes away between slices cancels the rest.
- `cli.py`: `epp slicer --upstream URL [--slice-tokens S]`.
"""
