"""Every core, every replica: request-path processes and EPP replicas that route as one.

- `table`: one row per writer per endpoint, the writers' own in-flight and ledger sums (readers
  sum), in a segment of `epp.shm` (the pod's shared-memory primitives);
- `peers`: folds the other writers' sums into this process's endpoints, publishes its own;
- `ring`: one single-producer ring per writer for the prefix picks; `prefix`: the index that
  broadcasts its adds through it; `member`: a process's link to all of it;
- `dispatcher`: the one set of flow-control queues of a multi-worker pod;
- `supervisor`: `epp serve --workers N`; `merge`: one /metrics and admin status for the pod;
- `replicas`: active-active replicas through Redis/Valkey, in the background.
"""
