"""EndpointPickerConfigs the virtual-time benchmarks compare: the built-in default (predicted
latency) and the presets (`epp.config.defaults.PRESETS`)."""

from __future__ import annotations

from epp.config.defaults import DEFAULT_CONFIG, REFERENCE_DEFAULT_CONFIG, WEIGHTED_CONFIG

DEFAULT = DEFAULT_CONFIG
WEIGHTED = WEIGHTED_CONFIG
REFERENCE = REFERENCE_DEFAULT_CONFIG
