"""The workload file: who sends what, when — validated into frozen specs.

Schema (YAML; every size in tokens, every time in seconds or a duration string like "500ms"):

    name: prefix-heavy                 # label for reports
    description: ...
    seed: 1                            # default seed (the CLI's --seed wins)
    duration: 60                       # arrivals stop here (per-class `stop` may end them sooner)
    max_requests: 0                    # stop creating requests after this many (0: no cap)
    warmup: 0                          # requests arriving before this are not in the statistics
    model: meta-llama/Llama-3.1-8B-Instruct
    tokenizer: bpe                     # bpe | tiny | chars4 | a directory with a tokenizer.json
    engine: {max_num_seqs: 256, ...}   # EngineConfig overrides for every pod (see epp.sim.config)
    objectives: {interactive: 0, batch: -1}   # InferenceObjective name -> priority
    classes:
    - name: chat
      rate: 20                         # arrivals/s (sessions/s for `chat`), or:
      rate_per_pod: 0.5                #   arrivals/s per simulated pod (portable across pool sizes)
      arrival: poisson                 # poisson | {process: gamma, cv: 3} (bursty renewal)
                                       # | {process: onoff, on_for: 2, off_for: 8} (Poisson at `rate` while on)
                                       # | {process: burst, count: 500, at: 0, spread: 0}
      start: 0                         # this class's arrivals begin / end (default: 0 / duration)
      stop: 60
      prompt: {dist: lognormal, mean: 300, sigma: 0.6}   # unique prompt tokens (see dist.py)
      output: {dist: lognormal, mean: 200, sigma: 0.6}   # tokens the model really generates
      max_tokens: 1024                 # the body's max_tokens (default: the drawn output length)
      prefix: {groups: 8, tokens: 2000, zipf: 0}   # shared system prompts: one of `groups`, each
                                                   # `tokens` long, chosen uniformly (or Zipf s)
      chat: {turns: 4, think_time: {dist: exponential, mean: 5}, message: 100}
                                       # multi-turn: each turn re-sends the conversation so far
                                       # (prompt + replies + a new `message`) after `think_time`
      tenants: 4                       # fairness ids <class>-0..3; or [alice, bob];
                                       # or {names: [...] | count: N, weights: [...] | zipf: s}
      objective: interactive           # x-gateway-inference-objective (priority from `objectives`)
      priority: -1                     # shorthand: an objective named after the class
      slo_ttft_ms: 500                 # sent as x-slo-ttft-ms; reports count SLO attainment
      lora: {adapters: [sql, chat], weights: [3, 1], base: 0.2}   # share `base` uses the base model

Sizes are tokens of the workload's tokenizer (`epp simulate --tokenizer` overrides it). Requests
are completions of English-like text (`epp.sim.tokenizers.text`): the engines count its tokens
with the real tokenizer, the EPP hashes its characters, so their blocks do not line up — as in
production. Shared prefixes are shared as text.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from epp.params import ConfigError, Params
from epp.sim.cluster.dist import Dist, constant, parse_dist
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.tokens import DEFAULT_TOKENIZER, load_tokenizer

PROCESSES = ("poisson", "gamma", "onoff", "burst")
_ENGINE_INT = ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
               "max_loras")
_ENGINE_STR = {"scheduling_policy": ("fcfs", "priority"), "batching": ("mixed", "prefill_first")}


@dataclass(slots=True, frozen=True)
class Arrival:
    process: str = "poisson"
    rate: float = 0.0  # per second; 0 with rate_per_pod > 0: rate_per_pod × pods
    rate_per_pod: float = 0.0
    cv: float = 1.0  # gamma: coefficient of variation of the gaps (> 1 is burstier than Poisson)
    on: float = 1.0  # onoff
    off: float = 0.0
    count: int = 0  # burst
    at: float = 0.0
    spread: float = 0.0

    def resolved_rate(self, pods: int) -> float:
        return self.rate if self.rate > 0 else self.rate_per_pod * pods


@dataclass(slots=True, frozen=True)
class Choice:
    """Names with cumulative weights (tenants, LoRA adapters); Zipf or explicit weights."""

    names: tuple[str, ...]
    cum_weights: tuple[float, ...]

    def pick(self, u: float) -> str:
        return self.names[bisect.bisect(self.cum_weights, u * self.cum_weights[-1])]


@dataclass(slots=True, frozen=True)
class PrefixSpec:
    groups: int
    tokens: Dist
    zipf: float = 0.0


@dataclass(slots=True, frozen=True)
class ChatSpec:
    turns: Dist
    think_time: Dist
    message: Dist


@dataclass(slots=True, frozen=True)
class LoraSpec:
    adapters: Choice
    base: float = 0.0


@dataclass(slots=True, frozen=True)
class ClassSpec:
    name: str
    arrival: Arrival
    prompt: Dist
    output: Dist
    start: float = 0.0
    stop: float | None = None
    max_tokens: int | None = None
    prefix: PrefixSpec | None = None
    chat: ChatSpec | None = None
    tenants: Choice | None = None
    objective: str = ""
    priority: int | None = None
    slo_ttft: float | None = None  # seconds
    lora: LoraSpec | None = None


@dataclass(slots=True, frozen=True)
class Workload:
    classes: tuple[ClassSpec, ...]
    name: str = "workload"
    description: str = ""
    seed: int = 1
    duration: float = 60.0
    max_requests: int = 0
    warmup: float = 0.0
    model: str = SimConfig().model
    engine: dict[str, Any] = field(default_factory=dict)
    objectives: dict[str, int] = field(default_factory=dict)
    tokenizer: str = DEFAULT_TOKENIZER

    def sim_config(self) -> SimConfig:
        """The pods' configuration: engine overrides, every LoRA adapter in use, no token times."""
        adapters = sorted({a for c in self.classes if c.lora for a in c.lora.adapters.names})
        engine = EngineConfig(**{"record_token_times": False, **self.engine})
        if adapters and not engine.max_loras:
            engine.max_loras = min(4, len(adapters))
        config = SimConfig(model=self.model, lora_adapters=tuple(adapters), engine=engine,
                           tokenizer=self.tokenizer)
        config.validate()
        return config

    def all_objectives(self) -> dict[str, int]:
        """Top-level objectives plus the ones classes declare with `priority`."""
        out = dict(self.objectives)
        for c in self.classes:
            if c.priority is not None:
                out[c.objective] = c.priority
        return out

    def scaled(self, *, rate: float = 1.0, duration: float | None = None, max_requests: int | None = None,
               warmup: float | None = None) -> Workload:
        """The same workload at `rate` times the arrival rates (burst counts too), or other limits.

        A shorter `duration` also caps the warm-up at a quarter of it (unless `warmup` is given),
        so a shortened run still has something to measure.
        """
        classes = tuple(replace(c, arrival=replace(c.arrival, rate=c.arrival.rate * rate,
                                                   rate_per_pod=c.arrival.rate_per_pod * rate,
                                                   count=int(round(c.arrival.count * rate))))
                        for c in self.classes)
        new_duration = self.duration if duration is None else duration
        if warmup is None:
            warmup = self.warmup if duration is None else min(self.warmup, new_duration / 4)
        return replace(self, classes=classes, duration=new_duration, warmup=warmup,
                       max_requests=self.max_requests if max_requests is None else max_requests)


# -- reading --


class _Section(Params):
    """`Params` plus raw access for fields that may be a number or a mapping (distributions)."""

    def raw(self, key: str) -> Any:
        return self._get(key)


def load_workload(source: str | Path) -> Workload:
    """A workload from a file path, or the name of a shipped one (`epp/sim/workloads/<name>.yaml`)."""
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read workload: {exc}") from None
        return parse_workload(text)
    return parse_workload(builtin_text(str(source)))


def builtin_names() -> list[str]:
    files = resources.files("epp.sim.workloads")
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


def builtin_text(name: str) -> str:
    files = resources.files("epp.sim.workloads")
    item = files.joinpath(f"{name}.yaml")
    if not item.is_file():
        raise ConfigError(f"no workload file or shipped workload named {name!r} "
                          f"(shipped: {', '.join(builtin_names())})")
    return item.read_text(encoding="utf-8")


def parse_workload(text: str) -> Workload:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"workload: invalid YAML: {exc}") from None
    p = _Section(raw, "workload")
    name = p.str("name", "workload")
    description = p.str("description", "")
    seed = p.int("seed", 1)
    duration = p.duration("duration", 60.0)
    max_requests = p.int("max_requests", 0, min=0)
    warmup = p.duration("warmup", 0.0)
    model = p.str("model", SimConfig().model)
    tokenizer = p.str("tokenizer", DEFAULT_TOKENIZER)
    engine = _engine(_Section(p.mapping("engine"), "workload.engine"))
    objectives: dict[str, int] = {}
    for key, value in p.mapping("objectives").items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"workload.objectives.{key}: must map a name to an integer priority")
        objectives[key] = value
    raw_classes = p.list("classes")
    if not raw_classes:
        raise p.error("classes", "at least one class is required")
    classes = []
    for i, entry in enumerate(raw_classes):
        classes.append(_class(_Section(entry, f"workload.classes[{i}]"), i, objectives))
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise p.error("classes", "class names must be unique")
    p.done()
    workload = Workload(classes=tuple(classes), name=name, description=description, seed=seed,
                        duration=duration, max_requests=max_requests, warmup=warmup, model=model,
                        engine=engine, objectives=objectives, tokenizer=tokenizer)
    try:
        load_tokenizer(tokenizer)
    except ValueError as exc:
        raise ConfigError(f"workload.tokenizer: {exc}") from None
    try:
        workload.sim_config()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"workload.engine: {exc}") from None
    return workload


def _engine(p: Params) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in _ENGINE_INT:
        if p.has(key):
            out[key] = p.int(key, 0, min=0)
    for key, choices in _ENGINE_STR.items():
        if p.has(key):
            out[key] = p.str(key, "", choices=choices)
    if p.has("enable_prefix_caching"):
        out["enable_prefix_caching"] = p.bool("enable_prefix_caching", True)
    if p.has("step_profile"):
        out["step_profile"] = p.str("step_profile", "")
    p.done()
    return out


def _class(p: Params, index: int, objectives: dict[str, int]) -> ClassSpec:
    name = p.str("name", f"class{index}")
    arrival = _arrival(p)
    start = p.duration("start", 0.0)
    stop = p.duration("stop", math.inf)
    prompt = parse_dist(p.raw("prompt") if p.has("prompt") else 256, f"{p.path}.prompt")
    output = parse_dist(p.raw("output") if p.has("output") else 128, f"{p.path}.output")
    max_tokens = p.int("max_tokens", 0, min=0) or None
    prefix = None
    if p.has("prefix"):
        s = _Section(p.mapping("prefix"), f"{p.path}.prefix")
        prefix = PrefixSpec(groups=s.int("groups", 1, min=1),
                            tokens=parse_dist(s.raw("tokens") if s.has("tokens") else 1000, f"{s.path}.tokens"),
                            zipf=s.float("zipf", 0.0, min=0.0))
        s.done()
    chat = None
    if p.has("chat"):
        s = _Section(p.mapping("chat"), f"{p.path}.chat")
        chat = ChatSpec(turns=_dist(s, "turns", 4), think_time=_dist(s, "think_time", 5.0),
                        message=_dist(s, "message", 64))
        s.done()
    tenants = _choice(p.raw("tenants"), f"{p.path}.tenants", prefix=name) if p.has("tenants") else None
    objective = p.str("objective", "")
    priority = None
    if p.has("priority"):
        priority = p.int("priority", 0)
        if objective and objectives.get(objective, priority) != priority:
            raise p.error("priority", f"conflicts with objective {objective!r}'s priority")
        objective = objective or name
    elif objective and objective not in objectives:
        raise p.error("objective", f"unknown objective {objective!r}: add it under workload.objectives")
    slo_ms = p.float("slo_ttft_ms", 0.0, min=0.0)
    lora = None
    if p.has("lora"):
        raw = p.raw("lora")
        if isinstance(raw, list):
            raw = {"adapters": raw}
        s = _Section(raw, f"{p.path}.lora")
        names = s.list("adapters")
        if not names or not all(isinstance(n, str) and n for n in names):
            raise s.error("adapters", "must be a non-empty list of adapter names")
        lora = LoraSpec(adapters=_choice({"names": names, "weights": s.list("weights") or None},
                                         f"{s.path}", prefix=""),
                        base=s.float("base", 0.0, min=0.0, max=1.0))
        s.done()
    p.done()
    return ClassSpec(name=name, arrival=arrival, prompt=prompt, output=output, start=start,
                     stop=None if stop == math.inf else stop, max_tokens=max_tokens, prefix=prefix, chat=chat,
                     tenants=tenants, objective=objective, priority=priority,
                     slo_ttft=slo_ms / 1000.0 if slo_ms else None, lora=lora)


def _dist(p: Params, key: str, default: float) -> Dist:
    return parse_dist(p.raw(key), f"{p.path}.{key}") if p.has(key) else constant(default)


def _arrival(p: Params) -> Arrival:
    rate = p.float("rate", 0.0, min=0.0)
    per_pod = p.float("rate_per_pod", 0.0, min=0.0)
    raw = p.raw("arrival") if p.has("arrival") else "poisson"
    if isinstance(raw, str):
        raw = {"process": raw}
    s = _Section(raw, f"{p.path}.arrival")
    process = s.str("process", "poisson", choices=PROCESSES)
    arrival = Arrival(process=process, rate=rate, rate_per_pod=per_pod,
                      cv=s.float("cv", 1.0, min=0.0, min_exclusive=True),
                      on=s.duration("on_for", 1.0), off=s.duration("off_for", 0.0),
                      count=s.int("count", 0, min=0), at=s.duration("at", 0.0), spread=s.duration("spread", 0.0))
    s.done()
    if process == "burst":
        if arrival.count <= 0:
            raise ConfigError(f"{s.path}.count: a burst needs count > 0")
    elif rate <= 0 and per_pod <= 0:
        raise p.error("rate", "give rate or rate_per_pod (> 0)")
    if process == "onoff" and arrival.on <= 0:
        raise ConfigError(f"{s.path}.on_for: must be > 0")
    return arrival


def _choice(raw: Any, path: str, *, prefix: str) -> Choice:
    """Tenants or adapters: a count, a list of names, or {names|count, weights|zipf}."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = {"count": raw}
    elif isinstance(raw, list):
        raw = {"names": raw}
    s = _Section(raw, path)
    names = s.list("names")
    count = s.int("count", 0, min=0)
    if names and count:
        raise s.error("count", "give names or count, not both")
    if not names:
        if count <= 0:
            raise s.error("count", "must be > 0 (or give names)")
        names = [f"{prefix}-{i}" if prefix else str(i) for i in range(count)]
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise s.error("names", "must be distinct non-empty strings")
    weights = s.list("weights")
    zipf = s.float("zipf", 0.0, min=0.0)
    s.done()
    if weights:
        if len(weights) != len(names) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights) \
                or sum(weights) <= 0:
            raise ConfigError(f"{path}.weights: must be {len(names)} numbers >= 0, not all 0")
        ws = [float(w) for w in weights]
    else:
        ws = [1.0 / (i + 1) ** zipf for i in range(len(names))]
    return Choice(tuple(names), tuple(itertools.accumulate(ws)))
