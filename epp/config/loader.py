"""Read a GIE `EndpointPickerConfig` YAML into a ready scheduler, detector and plugin lists.

The format is the reference's (apiVersion `inference.networking.x-k8s.io/v1alpha1`, kind
`EndpointPickerConfig`), decoded strictly: an unknown field, a duplicate key or a wrong type
anywhere is a `ConfigError` whose message starts with the field's path, e.g.
`schedulingProfiles[0].plugins[1].weight: must be a number`.

System defaults follow the reference's `applySystemDefaults`:
- no `schedulingProfiles`: one profile `default` with every configured Filter and Scorer (weight
  1) and the first Picker;
- one profile and no profile handler: `single-profile-handler` is added; more than one handler,
  or `single-profile-handler` with several profiles, is an error;
- a profile without a picker gets the first configured picker, else a created `max-score-picker`;
- a scorer without a weight gets 1.0 (weights are only for scorers; elsewhere they are ignored
  with a warning, as the reference ignores them);
- producers a plugin needs are created with default parameters (`prefix-cache-scorer` pulls in
  `approx-prefix-cache-producer`);
- `saturationDetector` omitted: a configured `utilization-detector` is used, else one is created;
- `dataLayer` omitted: the configured (or created) `metrics-data-source` + `core-metrics-extractor`;
  `dataLayer: {sources: []}` turns metric collection off;
- `parser` omitted: a configured parser plugin, else `openai-parser` (the only parser: a
  `passthrough-parser` is rejected, since every request body is parsed as OpenAI JSON);
- `enableLegacyMetrics` is the reference's fallback to its pre-data-layer metrics polling, which
  scrapes `http://<pod>:<port>/metrics` with the built-in vLLM names and ignores `dataLayer`:
  with the gate, metrics are collected by a default `metrics-data-source` and
  `core-metrics-extractor`, and a `dataLayer` section is ignored with a warning;
- `dataLayer` takes one source with one extractor (the scraper reads one metrics endpoint per
  pod); more, or a source without an extractor, is an error;
- `flowControl` is read only when the `flowControl` feature gate is on (otherwise it is ignored
  with a warning). With the gate on it is validated into `flow_control_config`
  (`epp.flowcontrol.config`), and the reference's default policies `global-strict-fairness-policy`,
  `fcfs-ordering-policy` and `static-usage-limit-policy` are created when not configured. A policy
  ref that names a policy type not listed in `plugins` creates that policy with default parameters.

Nothing is silent: every default applied is listed in `LoadedConfig.defaults` and every plugin
a default created in `LoadedConfig.injected` (with why), both printed by `epp check-config
--effective` and at `epp serve` start; a plugin that is configured but used by nothing, and any
section that is ignored, is a warning (`LoadedConfig.warnings`, printed too).

No config (`text=None`) means `epp.config.defaults.DEFAULT_CONFIG`, the `predicted-latency`
preset: candidates are ranked by a predicted time to first token in seconds (see
`predicted-latency-producer`), not by a weighted sum. Explicit GIE configs behave as they do in
GIE; the reference's own default is the `reference` preset (`REFERENCE_DEFAULT_CONFIG`), and this
project's previous weighted default the `weighted` preset.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from epp.api.preparer import RequestPreparer
from epp.config.defaults import DEFAULT_CONFIG
from epp.config.effective import describe
from epp.params import ConfigError, Params
from epp.config.parsers import DEFAULT_PARSER, UNSUPPORTED_PARSERS, RequestParser
from epp.config.plugin_types import (
    CORE_METRICS_EXTRACTOR,
    DATA_EXTRACTOR_TYPES,
    DATA_SOURCE_TYPES,
    METRICS_DATA_SOURCE,
    all_plugin_types,
)
from epp.datastore import Datastore
from epp.flowcontrol.config import FlowControlConfig, check_plugin, parse_flow_control
from epp.flowcontrol.plugins import DEFAULT_FAIRNESS, DEFAULT_ORDERING, DEFAULT_USAGE_LIMIT
from epp.flowcontrol.plugins import PLUGIN_CLASSES as FLOW_CONTROL_CLASSES
from epp.flowcontrol.saturation import SaturationDetector
from epp.flowcontrol.utilization_detector import UtilizationDetector
from epp.scheduling.framework import (
    DataProducer,
    Filter,
    Picker,
    Plugin,
    PreRequest,
    ProfileHandler,
    ResponseComplete,
    ResponseReceived,
    SchedulerProfile,
    Scorer,
    WeightedScorer,
)
from epp.scheduling.plugins._requires import RequiresProducers, unique_name
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.plugins.single_profile_handler import SingleProfileHandler
from epp.plugin import PluginContext
from epp.scheduling.scheduler import Scheduler

API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
KIND = "EndpointPickerConfig"
LEGACY_METRICS_GATE = "enableLegacyMetrics"
FEATURE_GATES = ("dataLayer", LEGACY_METRICS_GATE, "flowControl")
DEFAULT_PROFILE = "default"

_TOP_LEVEL = (
    "apiVersion",
    "kind",
    "featureGates",
    "plugins",
    "schedulingProfiles",
    "saturationDetector",
    "dataLayer",
    "flowControl",
    "parser",
)


@dataclass(slots=True)
class DataSourceBinding:
    """One `dataLayer.sources` entry: where to collect from, and what to extract."""

    source: Plugin
    extractors: list[Plugin]


@dataclass(slots=True)
class LoadedConfig:
    """Everything the runner wires together, built and validated."""

    scheduler: Scheduler
    saturation_detector: SaturationDetector
    plugins: dict[str, Plugin]  # by name, configured first, then the ones defaults created
    pre_request: list[PreRequest]
    response_received: list[ResponseReceived]
    response_complete: list[ResponseComplete]
    data_layer: list[DataSourceBinding] | None  # None: metric collection is off
    feature_gates: frozenset[str]
    flow_control: dict[str, Any] | None  # raw `flowControl` mapping; None unless the gate is on
    parser: str  # the parser plugin's type, e.g. "openai-parser"
    warnings: list[str] = field(default_factory=list)
    flow_control_config: FlowControlConfig | None = None  # validated; None unless the gate is on
    injected: dict[str, str] = field(default_factory=dict)  # plugin name -> why a default created it
    defaults: list[str] = field(default_factory=list)  # every other default applied, as "field: what"

    def effective(self) -> dict[str, Any]:
        """The configuration as it runs, every default included (see `epp.config.effective`)."""
        return describe(self)

    @property
    def data_source(self) -> Plugin | None:
        """The first data source (the runner's scraper takes one source and one extractor)."""
        return self.data_layer[0].source if self.data_layer else None

    @property
    def extractor(self) -> Plugin | None:
        if not self.data_layer or not self.data_layer[0].extractors:
            return None
        return self.data_layer[0].extractors[0]

    def flow_control_enabled(self) -> bool:
        return "flowControl" in self.feature_gates

    def legacy_metrics(self) -> bool:
        return LEGACY_METRICS_GATE in self.feature_gates


def load_config(text: str | None, datastore: Datastore, *, seed: int | None = None) -> LoadedConfig:
    """Build the configuration from YAML text; `None` means the default configuration.

    `seed` makes every plugin's randomness reproducible (the simulator's runs)."""
    raw = _parse_yaml(DEFAULT_CONFIG if text is None else text)
    builder = _Builder(datastore, seed)
    if text is None:
        builder.defaults.append("config: none given, the built-in default (the reference's default plus "
                                "active-request-scorer with weight 2; see epp.config.defaults)")
    return builder.build(raw)


def load_config_file(path: str | Path, datastore: Datastore) -> LoadedConfig:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from None
    return load_config(text, datastore)


# -- YAML --


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, as the reference's strict decoding does."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in mapping
        except TypeError:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: unsupported mapping key") from None
        if duplicate:
            raise ConfigError(f"{key}: duplicate field (line {key_node.start_mark.line + 1})")
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str) -> Any:
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: invalid YAML: {exc}") from None
    if raw is None:
        raise ConfigError("config: empty document")
    return raw


# -- small validators; every message starts with the field path --


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _mapping(value: Any, path: str, allowed: Iterable[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: must be a mapping, got {_kind(value)}")
    allowed = tuple(allowed)
    for key in value:
        if key not in allowed:
            hint = " (the field is `dataLayer`)" if key == "data" and "dataLayer" in allowed else ""
            raise ConfigError(f"{_join(path, key)}: unknown field{hint}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{path}: must be a list, got {_kind(value)}")
    return value


def _string(value: Any, path: str, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        got = "nothing" if value is None else _kind(value)
        raise ConfigError(f"{path}: must be a non-empty string, got {got}")
    return value


def _describe(plugin: Plugin) -> str:
    return f"{plugin.name!r} (type {plugin.type})"


def _producer_order(producers: list[DataProducer]) -> list[DataProducer]:
    """Producers in config order, except that each runs after the producers it reads."""
    by_name = {p.name: p for p in producers}
    ordered: list[DataProducer] = []
    state: dict[str, int] = {}  # 1: visiting, 2: placed

    def place(p: DataProducer) -> None:
        if state.get(p.name) == 2:
            return
        if state.get(p.name) == 1:
            raise ConfigError(f"plugins: data producers depend on each other in a cycle ({p.name!r})")
        state[p.name] = 1
        for name in p.depends_on():
            if name in by_name:
                place(by_name[name])
        state[p.name] = 2
        ordered.append(p)

    for producer in producers:
        place(producer)
    return ordered


# -- the builder --


class _Builder:
    def __init__(self, datastore: Datastore, seed: int | None = None) -> None:
        self.ctx = PluginContext(datastore=datastore, seed=seed)
        self.plugins = self.ctx.plugins
        self.warnings: list[str] = []
        self.types = all_plugin_types()
        self.injected: dict[str, str] = {}
        self.defaults: list[str] = []

    def build(self, raw: Any) -> LoadedConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"config: must be a mapping, got {_kind(raw)}")
        root = _mapping(raw, "", _TOP_LEVEL)
        self._header(root)
        gates = self._feature_gates(root.get("featureGates"))
        self._plugins(root.get("plugins"))
        self._missing_producers()
        profiles = self._profiles(root.get("schedulingProfiles"))
        handler = self._handler(profiles)
        self._pickers(profiles)
        detector = self._saturation_detector(root)
        data_layer = self._data_layer(root, gates)
        parser = self._parser(root)
        flow_control = self._flow_control(root, gates)
        flow_control_config = self._flow_control_config(flow_control)
        if flow_control_config is not None and data_layer is None and isinstance(detector, UtilizationDetector):
            self.warnings.append("flowControl: no metrics are collected (dataLayer.sources is empty), so the "
                                 "utilization-detector counts every endpoint as saturated and nothing is dispatched; "
                                 "use the concurrency-detector or collect metrics")
        self._unused(profiles, handler, detector, data_layer, parser, flow_control_config)

        plugins = dict(self.plugins)
        values = list(plugins.values())
        scheduler = Scheduler(
            {p.name: p for p in profiles},
            handler,
            _producer_order([p for p in values if isinstance(p, DataProducer)]),
        )
        return LoadedConfig(
            scheduler=scheduler,
            saturation_detector=detector,
            plugins=plugins,
            pre_request=[p for p in values if isinstance(p, PreRequest)],
            response_received=[p for p in values if isinstance(p, ResponseReceived)],
            response_complete=[p for p in values if isinstance(p, ResponseComplete)],
            data_layer=data_layer,
            feature_gates=gates,
            flow_control=flow_control,
            parser=parser.type,
            warnings=self.warnings,
            flow_control_config=flow_control_config,
            injected=self.injected,
            defaults=self.defaults,
        )

    # -- header and gates --

    def _header(self, root: dict[str, Any]) -> None:
        for key, expected in (("apiVersion", API_VERSION), ("kind", KIND)):
            value = root.get(key)
            if value is None:
                raise ConfigError(f"{key}: required, must be {expected!r}")
            if value != expected:
                raise ConfigError(f"{key}: must be {expected!r}, got {value!r}")

    def _feature_gates(self, value: Any) -> frozenset[str]:
        gates: set[str] = set()
        for i, gate in enumerate(_list(value, "featureGates")):
            path = f"featureGates[{i}]"
            _string(gate, path)
            if gate not in FEATURE_GATES:
                raise ConfigError(f"{path}: unknown feature gate {gate!r} (known: {', '.join(FEATURE_GATES)})")
            if gate == "dataLayer":
                self.warnings.append(f"{path}: dataLayer is deprecated, the data layer is always on")
            if gate in gates:
                self.warnings.append(f"{path}: {gate} is listed twice")
            gates.add(gate)
        return frozenset(gates)

    # -- plugins --

    def _plugins(self, value: Any) -> None:
        for i, entry in enumerate(_list(value, "plugins")):
            path = f"plugins[{i}]"
            entry = _mapping(entry, path, ("name", "type", "parameters"))
            type_name = _string(entry.get("type"), f"{path}.type")
            cls = self.types.get(type_name)
            if type_name in UNSUPPORTED_PARSERS:
                raise ConfigError(f"{path}.type: {UNSUPPORTED_PARSERS[type_name]}")
            if cls is None:
                raise ConfigError(
                    f"{path}.type: unknown plugin type {type_name!r} (known: {', '.join(sorted(self.types))})"
                )
            name = _string(entry.get("name"), f"{path}.name", required=False) or type_name
            if name in self.plugins:
                raise ConfigError(f"{path}.name: duplicate plugin name {name!r}")
            self.plugins[name] = self._create(cls, name, entry.get("parameters"), f"{path}.parameters")

    def _create(self, cls: type[Plugin], name: str, parameters: Any, path: str) -> Plugin:
        try:
            return cls.from_config(name, Params(parameters, path), self.ctx)
        except ConfigError:
            raise
        except ValueError as exc:  # a constructor's own validation
            raise ConfigError(f"{path}: {exc}") from None

    def _add_default(self, type_name: str, why: str) -> Plugin:
        """Create a plugin the defaults need, with default parameters, under a free name."""
        name = unique_name(type_name, self.plugins)
        plugin = self._create(self.types[type_name], name, None, f"<default {type_name}>")
        self.plugins[name] = plugin
        self.injected[name] = why
        return plugin

    def _first(self, cls: type[Any], type_name: str = "") -> Any:
        for plugin in self.plugins.values():
            if isinstance(plugin, cls) and (not type_name or plugin.type == type_name):
                return plugin
        return None

    def _missing_producers(self) -> None:
        for plugin in list(self.plugins.values()):
            if isinstance(plugin, RequiresProducers):
                for created in plugin.create_missing_producers(self.ctx):
                    if created.name in self.plugins:
                        raise ConfigError(f"plugins: created plugin name {created.name!r} is already taken")
                    self.plugins[created.name] = created
                    self.injected[created.name] = f"a data producer {_describe(plugin)} needs"

    # -- scheduling profiles --

    def _profiles(self, value: Any) -> list[SchedulerProfile]:
        entries = _list(value, "schedulingProfiles")
        if not entries:
            return [self._default_profile()]
        profiles: list[SchedulerProfile] = []
        names: set[str] = set()
        for i, entry in enumerate(entries):
            path = f"schedulingProfiles[{i}]"
            entry = _mapping(entry, path, ("name", "plugins"))
            name = _string(entry.get("name"), f"{path}.name")
            if name in names:
                raise ConfigError(f"{path}.name: duplicate profile name {name!r}")
            names.add(name)
            profile = SchedulerProfile(name=name)
            refs: set[str] = set()
            for j, ref_entry in enumerate(_list(entry.get("plugins"), f"{path}.plugins")):
                self._profile_plugin(profile, ref_entry, f"{path}.plugins[{j}]", refs)
            profiles.append(profile)
        return profiles

    def _profile_plugin(self, profile: SchedulerProfile, entry: Any, path: str, refs: set[str]) -> None:
        entry = _mapping(entry, path, ("pluginRef", "weight"))
        ref = _string(entry.get("pluginRef"), f"{path}.pluginRef")
        plugin = self.plugins.get(ref)
        if plugin is None:
            known = ", ".join(self.plugins) or "none"
            raise ConfigError(f"{path}.pluginRef: no plugin named {ref!r} (defined: {known})")
        if ref in refs:
            raise ConfigError(f"{path}.pluginRef: plugin {ref!r} is listed twice in profile {profile.name!r}")
        refs.add(ref)
        weight = entry.get("weight")
        if weight is not None and (
            isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight)
        ):
            raise ConfigError(f"{path}.weight: must be a number, got {weight!r}")
        if not isinstance(plugin, (Filter, Scorer, Picker)):
            raise ConfigError(f"{path}.pluginRef: {_describe(plugin)} is not a filter, scorer or picker")
        if isinstance(plugin, Filter):
            profile.filters.append(plugin)
        if isinstance(plugin, Scorer):
            profile.scorers.append(WeightedScorer(plugin, 1.0 if weight is None else float(weight)))
            if weight is None:
                self.defaults.append(f"{path}.weight: 1.0 (no weight given for scorer {plugin.name!r})")
        elif weight is not None:
            self.warnings.append(f"{path}.weight: ignored, {_describe(plugin)} is not a scorer")
        if isinstance(plugin, Picker):
            if profile.picker is not None:
                raise ConfigError(
                    f"{path}.pluginRef: profile {profile.name!r} already has picker {profile.picker.name!r}"
                )
            profile.picker = plugin

    def _default_profile(self) -> SchedulerProfile:
        self.defaults.append(f"schedulingProfiles: one profile {DEFAULT_PROFILE!r} with every filter and scorer "
                             "(weight 1.0) and the first picker (no profiles given)")
        profile = SchedulerProfile(name=DEFAULT_PROFILE)
        for plugin in self.plugins.values():
            if isinstance(plugin, Filter):
                profile.filters.append(plugin)
            if isinstance(plugin, Scorer):
                profile.scorers.append(WeightedScorer(plugin, 1.0))
            if isinstance(plugin, Picker) and profile.picker is None:
                profile.picker = plugin
        return profile

    def _handler(self, profiles: list[SchedulerProfile]) -> ProfileHandler:
        handlers = [p for p in self.plugins.values() if isinstance(p, ProfileHandler)]
        if len(handlers) > 1:
            names = ", ".join(repr(h.name) for h in handlers)
            raise ConfigError(f"plugins: only one profile handler may be configured, found {names}")
        if handlers:
            handler = handlers[0]
        elif len(profiles) == 1:
            created = self._add_default(SingleProfileHandler.type, "one scheduling profile and no profile handler")
            assert isinstance(created, ProfileHandler)
            handler = created
        else:
            raise ConfigError("schedulingProfiles: several profiles need a profile handler plugin")
        if isinstance(handler, SingleProfileHandler) and len(profiles) > 1:
            raise ConfigError(
                f"schedulingProfiles: {_describe(handler)} handles exactly one profile, got {len(profiles)}"
            )
        return handler

    def _pickers(self, profiles: list[SchedulerProfile]) -> None:
        if all(p.picker is not None for p in profiles):
            return
        picker = self._first(Picker) or self._add_default(MaxScorePicker.type, "a profile without a picker")
        assert isinstance(picker, Picker)
        for profile in profiles:
            if profile.picker is None:
                profile.picker = picker
                self.defaults.append(f"schedulingProfiles[{profile.name}].picker: {picker.name!r} "
                                     "(the profile names no picker)")

    # -- other sections --

    def _saturation_detector(self, root: dict[str, Any]) -> SaturationDetector:
        section = root.get("saturationDetector")
        if section is None:
            found = self._first(UtilizationDetector, UtilizationDetector.type)
            detector = found or self._add_default(UtilizationDetector.type, "saturationDetector omitted")
            if found is not None:
                self.defaults.append(f"saturationDetector: the configured {_describe(found)} (section omitted)")
            assert isinstance(detector, SaturationDetector)
            return detector
        section = _mapping(section, "saturationDetector", ("pluginRef",))
        plugin = self._ref(section.get("pluginRef"), "saturationDetector.pluginRef")
        if not isinstance(plugin, SaturationDetector):
            raise ConfigError(f"saturationDetector.pluginRef: {_describe(plugin)} is not a saturation detector")
        return plugin

    def _ref(self, value: Any, path: str) -> Plugin:
        ref = _string(value, path)
        plugin = self.plugins.get(ref)
        if plugin is None:
            raise ConfigError(f"{path}: no plugin named {ref!r} (defined: {', '.join(self.plugins) or 'none'})")
        return plugin

    def _default_binding(self, why: str) -> DataSourceBinding:
        """The configured (else a created) metrics-data-source + core-metrics-extractor."""
        plugins = []
        for type_name in (METRICS_DATA_SOURCE, CORE_METRICS_EXTRACTOR):
            found = self._first(Plugin, type_name)
            if found is not None:
                self.defaults.append(f"dataLayer: the configured {_describe(found)} ({why})")
            plugins.append(found or self._add_default(type_name, why))
        return DataSourceBinding(plugins[0], [plugins[1]])

    def _data_layer(self, root: dict[str, Any], gates: frozenset[str]) -> list[DataSourceBinding] | None:
        if LEGACY_METRICS_GATE in gates:
            return self._legacy_data_layer(root)
        if "dataLayer" not in root:
            return [self._default_binding("dataLayer omitted")]
        section = root["dataLayer"]
        section = _mapping({} if section is None else section, "dataLayer", ("sources",))
        bindings: list[DataSourceBinding] = []
        for i, entry in enumerate(_list(section.get("sources"), "dataLayer.sources")):
            path = f"dataLayer.sources[{i}]"
            entry = _mapping(entry, path, ("pluginRef", "extractors"))
            source = self._ref(entry.get("pluginRef"), f"{path}.pluginRef")
            if source.type not in DATA_SOURCE_TYPES:
                raise ConfigError(f"{path}.pluginRef: {_describe(source)} is not a data source")
            if bindings:
                raise ConfigError(f"{path}: only one data source is supported (each endpoint is scraped from one "
                                  f"metrics endpoint, {_describe(bindings[0].source)}); remove the others")
            extractors: list[Plugin] = []
            for j, ext_entry in enumerate(_list(entry.get("extractors"), f"{path}.extractors")):
                ext_path = f"{path}.extractors[{j}]"
                ext_entry = _mapping(ext_entry, ext_path, ("pluginRef",))
                extractor = self._ref(ext_entry.get("pluginRef"), f"{ext_path}.pluginRef")
                if extractor.type not in DATA_EXTRACTOR_TYPES:
                    raise ConfigError(f"{ext_path}.pluginRef: {_describe(extractor)} is not a metrics extractor")
                if extractors:
                    raise ConfigError(f"{ext_path}: only one extractor per source is supported (one "
                                      f"core-metrics-extractor reads every engine's metrics; its engineConfigs "
                                      f"add or change engines)")
                extractors.append(extractor)
            if not extractors:
                raise ConfigError(f"{path}.extractors: a source needs one extractor (e.g. core-metrics-extractor); "
                                  "to turn metric collection off, give `dataLayer: {sources: []}`")
            bindings.append(DataSourceBinding(source, extractors))
        return bindings or None

    def _legacy_data_layer(self, root: dict[str, Any]) -> list[DataSourceBinding]:
        """`enableLegacyMetrics`: collect as the reference's legacy polling does, from
        `http://<pod>:<port>/metrics` with the built-in metric names, whatever `dataLayer` says."""
        if "dataLayer" in root:
            self.warnings.append(f"dataLayer: ignored, the {LEGACY_METRICS_GATE} feature gate collects metrics the "
                                 "legacy way (a default metrics-data-source and core-metrics-extractor)")
        why = f"the {LEGACY_METRICS_GATE} feature gate (legacy metrics collection)"
        source = self._add_default(METRICS_DATA_SOURCE, why)
        extractor = self._add_default(CORE_METRICS_EXTRACTOR, why)
        return [DataSourceBinding(source, [extractor])]

    def _parser(self, root: dict[str, Any]) -> Plugin:
        section = root.get("parser")
        if section is None:
            found = self._first(RequestParser)
            if found is not None:
                self.defaults.append(f"parser: the configured {_describe(found)} (section omitted)")
            return found or self._add_default(DEFAULT_PARSER, "parser omitted")
        section = _mapping(section, "parser", ("pluginRef",))
        plugin = self._ref(section.get("pluginRef"), "parser.pluginRef")
        if not isinstance(plugin, RequestParser):
            raise ConfigError(f"parser.pluginRef: {_describe(plugin)} is not a request parser")
        return plugin

    def _flow_control(self, root: dict[str, Any], gates: frozenset[str]) -> dict[str, Any] | None:
        present = "flowControl" in root
        if "flowControl" not in gates:
            if present:
                self.warnings.append("flowControl: ignored, the flowControl feature gate is off")
            return None
        value = root.get("flowControl")
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"flowControl: must be a mapping, got {_kind(value)}")
        return value

    def _flow_control_config(self, raw: dict[str, Any] | None) -> FlowControlConfig | None:
        if raw is None:
            return None
        defaults = {}
        for key, type_name in (("fairness", DEFAULT_FAIRNESS), ("ordering", DEFAULT_ORDERING),
                               ("usageLimit", DEFAULT_USAGE_LIMIT)):
            found = self._first(Plugin, type_name)
            defaults[key] = (found or self._add_default(type_name, f"the flow-control default {key} policy")).name
        return parse_flow_control(raw, self._resolve_policy, defaults=defaults)

    def _resolve_policy(self, ref: str, path: str, kind: type[Any]) -> Any:
        plugin = self.plugins.get(ref)
        if plugin is None and ref in {cls.type for cls in FLOW_CONTROL_CLASSES}:
            plugin = self.plugins[ref] = self._create(self.types[ref], ref, None, f"<default {ref}>")
            self.injected[ref] = f"{path} names the policy type (created with default parameters)"
        if plugin is None:
            raise ConfigError(f"{path}: no plugin named {ref!r} (defined: {', '.join(self.plugins) or 'none'})")
        return check_plugin(plugin, path, kind)

    # -- plugins nothing uses --

    def _unused(self, profiles: list[SchedulerProfile], handler: ProfileHandler, detector: SaturationDetector,
                data_layer: list[DataSourceBinding] | None, parser: Plugin,
                flow_control: FlowControlConfig | None) -> None:
        """Warn about every configured plugin that nothing will call: a scorer left out of every
        profile, a data source with collection off, a policy while flow control is off, ..."""
        used: set[int] = {id(handler), id(detector), id(parser)}
        for profile in profiles:
            used.update(id(p) for p in profile.filters)
            used.update(id(ws.scorer) for ws in profile.scorers)
            used.add(id(profile.picker))
        for binding in data_layer or ():
            used.add(id(binding.source))
            used.update(id(e) for e in binding.extractors)
        if flow_control is not None:
            used.add(id(flow_control.usage_limit))
            for band in (flow_control.default_band, *flow_control.bands.values()):
                used.update((id(band.fairness), id(band.ordering)))
        # Called on every request (a preparer before admission, the rest around scheduling).
        always = (RequestPreparer, DataProducer, PreRequest, ResponseReceived, ResponseComplete)
        for plugin in self.plugins.values():
            if id(plugin) in used or isinstance(plugin, always) or plugin.name in self.injected:
                continue
            if plugin.type in _ALWAYS_ON:
                self.defaults.append(f"plugins: {_describe(plugin)} {_ALWAYS_ON[plugin.type]}")
                continue
            self.warnings.append(f"plugins: {_describe(plugin)} is configured but not used ({_why_unused(plugin)})")


# Reference types accepted for compatibility whose work this EPP always does anyway.
_ALWAYS_ON = {
    "inflight-load-producer": "is accepted for compatibility: request control always counts in-flight "
                              "requests and tokens per endpoint, at pick time",
}


def _why_unused(plugin: Plugin) -> str:
    if plugin.type in DATA_SOURCE_TYPES or plugin.type in DATA_EXTRACTOR_TYPES:
        return "not bound in dataLayer.sources"
    if isinstance(plugin, RequestParser):
        return "the parser section names another parser"
    if isinstance(plugin, SaturationDetector):
        return "not the saturationDetector and in no scheduling profile"
    if plugin.type in {cls.type for cls in FLOW_CONTROL_CLASSES}:
        return "flow control is off or no band refers to it"
    return "in no scheduling profile"
