"""Pod shapes of a simulated pool: `--pods 8:h100,8:a100:max_num_seqs=64` (or just `--pods 16`).

A spec is comma-separated groups, each `COUNT[:PROFILE][:KEY=VALUE]...`: how many pods, the
calibrated step-time profile they run (a unique prefix of its name is enough: `h100`, `a100`) and
engine settings that differ from the base configuration. A plain count keeps the base
configuration as it is. A group that names a profile gets that GPU's KV capacity
(`kv_capacity_blocks`), unless the capacity was given explicitly: by the group
(`num_gpu_blocks=`), or for the whole run (a workload's `engine: {num_gpu_blocks: …}`, `epp sim
--num-gpu-blocks`). An explicit capacity is a statement about the deployment (a larger model, a
smaller memory share) that a GPU's default must not silently undo: a workload sized to put the
KV cache under pressure keeps that pressure on every pool it runs on. Used by `epp simulate`
(virtual-time pods) and `epp sim` (HTTP pods) alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from epp.sim.config import EngineConfig
from epp.sim.steptime import kv_capacity_blocks, resolve_profile

MAX_PODS = 10_000

# The engine settings a group may set, with their types.
SETTINGS: dict[str, type] = {
    "num_gpu_blocks": int, "block_size": int, "max_num_seqs": int, "max_num_batched_tokens": int,
    "max_model_len": int, "max_loras": int, "lora_load_ms": float, "enable_prefix_caching": bool,
    "scheduler_reserve_full_isl": bool, "cpu_overhead": bool, "scheduling_policy": str,
    "batching": str,
}
_TRUE = {"true": True, "1": True, "yes": True, "on": True,
         "false": False, "0": False, "no": False, "off": False}


@dataclass(frozen=True, slots=True)
class PodGroup:
    """`count` pods of one shape."""

    count: int
    profile: str | None = None
    settings: tuple[tuple[str, object], ...] = ()

    def describe(self, base_profile: str = "base") -> str:
        """`a100-llama3-8b:max_num_seqs=64`; a group naming no profile shows `base_profile`."""
        parts = [self.profile or base_profile] + [f"{k}={v}" for k, v in self.settings]
        return ":".join(parts)


def parse_pods(spec: str | int) -> list[PodGroup]:
    """The groups of a `--pods` spec; ValueError (saying which part is wrong) for a bad one."""
    if isinstance(spec, int):
        spec = str(spec)
    text = spec.strip()
    if not text:
        raise ValueError("--pods: empty (give a count, e.g. 16, or groups, e.g. 8:h100,8:a100)")
    groups = [_group(part.strip(), spec) for part in text.split(",")]
    total = sum(g.count for g in groups)
    if total > MAX_PODS:
        raise ValueError(f"--pods {spec!r}: {total} pods is more than {MAX_PODS}")
    return groups


def pool_size(groups: Sequence[PodGroup]) -> int:
    return sum(g.count for g in groups)


def describe_pool(groups: Sequence[PodGroup], base_profile: str = "base") -> str:
    """`8 x h100-llama3-8b, 8 x a100-llama3-8b:max_num_seqs=64` (what a run prints)."""
    return ", ".join(f"{g.count} x {g.describe(base_profile)}" for g in groups)


def group_config(group: PodGroup, base: EngineConfig, explicit: Collection[str] = ()) -> EngineConfig:
    """The engine configuration of the group's pods, validated. `explicit`: the base's settings
    that were given explicitly (a workload's `engine` keys, flags on the command line)."""
    settings = dict(group.settings)
    cfg = dataclasses.replace(base, **settings)
    if group.profile is not None:
        cfg.step_profile = group.profile
    if "num_gpu_blocks" not in settings:
        if "num_gpu_blocks" in explicit:
            if cfg.block_size != base.block_size:  # the same tokens in blocks of another size
                cfg.num_gpu_blocks = base.num_gpu_blocks * base.block_size // cfg.block_size
        elif group.profile is not None or "block_size" in settings:
            cfg.num_gpu_blocks = kv_capacity_blocks(cfg.step_profile, cfg.block_size)
    try:
        cfg.validate()
    except ValueError as exc:
        raise ValueError(f"--pods group {group.count}:{group.describe()}: {exc}") from None
    return cfg


def engine_configs(groups: Sequence[PodGroup], base: EngineConfig,
                   explicit: Collection[str] = ()) -> list[EngineConfig]:
    """One configuration per pod, in pod order (the groups' pods one after the other)."""
    out: list[EngineConfig] = []
    for g in groups:
        cfg = group_config(g, base, explicit)
        out.extend(dataclasses.replace(cfg) for _ in range(g.count))
    return out


def _group(part: str, spec: str) -> PodGroup:
    where = f"--pods {spec!r}: group {part!r}"
    fields = part.split(":")
    try:
        count = int(fields[0])
    except ValueError:
        raise ValueError(f"{where}: a group starts with a pod count, e.g. 8:h100") from None
    if count < 1:
        raise ValueError(f"--pods must be >= 1 per group (group {part!r} of {spec!r})")
    profile = None
    settings: dict[str, object] = {}
    for i, f in enumerate(fields[1:]):
        if "=" not in f:
            if i != 0:
                raise ValueError(f"{where}: the profile comes right after the count; "
                                 f"{f!r} is not KEY=VALUE")
            try:
                profile = resolve_profile(f)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            continue
        key, _, raw = f.partition("=")
        key = key.strip()
        kind = SETTINGS.get(key)
        if kind is None:
            raise ValueError(f"{where}: unknown setting {key!r} (known: {', '.join(sorted(SETTINGS))})")
        if key in settings:
            raise ValueError(f"{where}: {key} given twice")
        settings[key] = _value(kind, raw.strip(), f"{where}: {key}")
    return PodGroup(count, profile, tuple(settings.items()))


def _value(kind: type, raw: str, where: str) -> object:
    if kind is bool:
        value = _TRUE.get(raw.lower())
        if value is None:
            raise ValueError(f"{where}: {raw!r} is not a boolean (true/false)")
        return value
    if kind is str:
        if not raw:
            raise ValueError(f"{where}: empty")
        return raw
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{where}: {raw!r} is not a{'n integer' if kind is int else ' number'}") from None
