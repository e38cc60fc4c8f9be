"""Shipped workload files for `epp simulate --workload NAME` (schema: `epp.sim.cluster.workload`)."""
