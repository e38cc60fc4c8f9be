"""How long one engine step takes on the modelled GPU.

The coefficients are a fit to measured per-operator GPU profiles (shared/calibration/step-time.md),
shipped as package data so the simulator needs no network or numpy. A step's cost is linear in the
prefill tokens (P), decode sequences (D), KV tokens read by decodes (K) and prefill query-key pairs
(Q): attention terms matter once contexts vary, which a tokens-only model would miss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

DEFAULT_PROFILE = "h100-llama3-8b"


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Linear step-time model; all coefficients in milliseconds."""

    c_ms: float
    prefill_ms_per_token: float
    decode_ms_per_seq: float
    attn_ms_per_kv_token: float
    prefill_attn_ms_per_qk_pair: float
    # Host overhead (scheduling, sampling) of an engine that does not overlap CPU and GPU work.
    cpu_c_ms: float = 0.0
    cpu_ms_per_seq: float = 0.0
    # The calibrated range: tokens per step, and tokens in one sequence's KV cache after the step
    # (prefix plus chunk, or context plus one decode token). Steps beyond it are extrapolations.
    max_tokens_per_step: int = 1 << 62
    max_context: int = 1 << 62

    def seconds(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int, qk_pairs: float,
                num_reqs: int) -> float:
        """Duration in seconds of a step with the given work."""
        ms = (self.c_ms + self.prefill_ms_per_token * prefill_tokens
              + self.decode_ms_per_seq * decode_seqs + self.attn_ms_per_kv_token * kv_tokens
              + self.prefill_attn_ms_per_qk_pair * qk_pairs)
        if num_reqs and (self.cpu_c_ms or self.cpu_ms_per_seq):
            ms += self.cpu_c_ms + self.cpu_ms_per_seq * num_reqs
        return ms * 1e-3

    @staticmethod
    def load(profile: str = DEFAULT_PROFILE, cpu_overhead: bool = False) -> StepTimeModel:
        """The fitted model of a named hardware profile (see `profiles()`)."""
        p = _profile(profile)
        return StepTimeModel(
            c_ms=p["c_ms"],
            prefill_ms_per_token=p["prefill_ms_per_token"],
            decode_ms_per_seq=p["decode_ms_per_seq"],
            attn_ms_per_kv_token=p["attn_ms_per_kv_token"],
            prefill_attn_ms_per_qk_pair=p["prefill_attn_ms_per_qk_pair"],
            cpu_c_ms=p["cpu_overhead_c_ms"] if cpu_overhead else 0.0,
            cpu_ms_per_seq=p["cpu_overhead_ms_per_seq"] if cpu_overhead else 0.0,
            max_tokens_per_step=int(p["calibrated_max_tokens_per_step"]),
            max_context=int(p["calibrated_max_context"]),
        )


def profiles() -> list[str]:
    """Names of the shipped hardware profiles."""
    return sorted(k for k in _data() if not k.startswith("_"))


def kv_capacity_blocks(profile: str = DEFAULT_PROFILE, block_size: int = 16) -> int:
    """KV-cache blocks of `block_size` tokens the profile's GPU holds for the model."""
    p = _profile(profile)
    tokens = int(p["kv_capacity_blocks"]) * int(p["block_size"])
    return tokens // block_size


def resolve_profile(name: str) -> str:
    """A profile's full name from itself or a unique prefix ("a100" -> "a100-llama3-8b")."""
    known = profiles()
    if name in known:
        return name
    matches = [p for p in known if p.startswith(name + "-")] if name else []
    if len(matches) == 1:
        return matches[0]
    raise ValueError(f"unknown step-time profile {name!r}; known: {', '.join(known)}")


def _profile(name: str) -> dict[str, float]:
    data = _data()
    if name.startswith("_") or name not in data:
        raise ValueError(f"unknown step-time profile {name!r}; known: {', '.join(profiles())}")
    return data[name]


@cache
def _data() -> dict[str, dict[str, float]]:
    text = resources.files(__package__).joinpath("steptime.json").read_text(encoding="utf-8")
    return json.loads(text)
