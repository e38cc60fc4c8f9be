"""The virtual-time cluster: N simulated engines, a workload, and the EPP's real request path.

`epp.sim.cluster.simulate.simulate(workload, pods=N, policies=[...])` runs one workload against
one or more policies (the EPP with given configs, random, round-robin, least-queue, oracle) and
returns their reports; `epp simulate` is its CLI. See `epp/sim/README.md` for the design and the
workload schema.
"""
