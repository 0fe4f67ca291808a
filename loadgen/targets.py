"""Which URL each benchmark mode is sent to, and how the mode is forced. Pure.

Two ways to run the modes, which may be mixed:

- one router (``--target``): every mode goes to it, and each request carries the header
  ``X-Syshax-Mode`` with the policy mode to force (``cpu-only``, ``gpu-only``, ``auto``),
  so the three modes run on identical engines;
- a target per mode (``--target-gpu``, ``--target-cpu``, ``--target-hetero``): that mode goes
  there unforced, e.g. straight to a GPU engine, a CPU engine, or a router left on its policy.

A per-mode target wins over the router for its mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from common.policy_schema import MODES as POLICY_MODES
from loadgen.client import FORCED_MODE_HEADER

BENCHMARK_MODES = ("cpu", "gpu", "hetero")  # MISSION.md's order: CPU, GPU, hetero
MODE_CHOICES = (*BENCHMARK_MODES, "all")
# The policy mode a router is asked to force for each benchmark mode.
# Hetero is the heterogeneous scheduler itself (auto, PD offload on), as in the documents'
# hetero mode; forced-pd would send every decode to the CPU whatever the load.
FORCED_POLICY = {"cpu": "cpu-only", "gpu": "gpu-only", "hetero": "auto"}
# A run against a plain target with no mode asked for is labelled so.
UNFORCED = "target"

assert set(FORCED_POLICY.values()) <= set(POLICY_MODES), "policy modes drifted"


class TargetError(ValueError):
    """The targets given cannot serve the modes asked for."""


@dataclass(frozen=True)
class Target:
    mode: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def forced(self) -> str | None:
        return self.headers.get(FORCED_MODE_HEADER)

    def to_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "url": self.url, "forced_policy_mode": self.forced}


def plan_targets(
    mode: str | None, router: str | None, per_mode: Mapping[str, str | None]
) -> list[Target]:
    """The (mode, URL, headers) of each run, in table order.

    ``mode`` None means: the modes that have their own target, else one unforced run
    against ``router``.
    """
    own = {name: url for name, url in per_mode.items() if url}
    unknown = set(own) - set(BENCHMARK_MODES)
    if unknown:
        raise TargetError(f"unknown mode(s) {sorted(unknown)}")
    if mode is None:
        if own:
            modes = [name for name in BENCHMARK_MODES if name in own]
        elif router:
            return [Target(UNFORCED, router)]
        else:
            raise TargetError("give --target URL, a --target-MODE URL, or --deployment NAME")
    elif mode == "all":
        modes = list(BENCHMARK_MODES)
    elif mode in BENCHMARK_MODES:
        modes = [mode]
    else:
        raise TargetError(f"unknown mode {mode!r} (choose from {', '.join(MODE_CHOICES)})")
    targets = []
    for name in modes:
        if name in own:
            targets.append(Target(name, own[name]))
        elif router:
            targets.append(Target(name, router, {FORCED_MODE_HEADER: FORCED_POLICY[name]}))
        else:
            raise TargetError(
                f"mode {name!r} needs --target-{name} URL, or --target URL of a router"
            )
    return targets
