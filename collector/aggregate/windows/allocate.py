"""Fair shares of one physical GPU in one window: each container's allocated and used GPU time,
and the GPU's idle time, in integer milliseconds that add up exactly.

Policies (`--allocation-policy`), as a share of the whole GPU at each instant the container is
present, integrated over the window:

* `cores`: SM limit / 100 (a limit of 0 or >= 100 is the whole GPU);
* `memory`: memory limit / device memory (at most 1); needs the NVML inventory, else `cores`
  (counted in `stats.allocation_fallbacks`);
* `max` (default): the larger of the two at each instant (`cores` alone without inventory,
  counted likewise);
* `usage`: what the container used (`used` below).

**Used** time, whatever the policy: the larger of the container's measured SM time (SM
percent-seconds / 100) and its memory share (memory byte-seconds / device memory, only with
inventory) over the window.

**Reserved but idle**, per container: the part of its allocated time accrued while its
measured SM utilisation on the device was 0 (no live process, or every process at `sm_util`
0): the policy's formula applied to that part of its present time alone (`usage`: the memory
share of that time), so it never exceeds the allocated time. When the GPU is overcommitted it
is the same fraction of the scaled allocation, rounded down (`idle_part`): a container never
busy is all reserved-idle, one always busy none.

Each container's time is rounded down to the millisecond. When the GPU's containers add up to
more than the GPU's observed time (HAMi can oversubscribe), they are scaled down to it
proportionally (largest remainder, ties to the earlier row), so the sum is exactly the observed
time; the allocation is then `overcommitted`. Idle = observed - sum, never negative. The
comparison is per window, not per instant: a window that is oversubscribed for half of its time
and half idle the rest shows as fully allocated and overcommitted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Literal

__all__ = ["POLICIES", "Policy", "allocated_ms", "fit", "idle_part", "observed_ms", "used_ms"]

Policy = Literal["cores", "memory", "max", "usage"]
POLICIES: Final[tuple[Policy, ...]] = ("cores", "memory", "max", "usage")


def _cores(sm_limit: int) -> int:
    """The SM share in percent: 0 (no limit) and anything >= 100 are the whole GPU."""
    return 100 if sm_limit <= 0 or sm_limit >= 100 else sm_limit


def allocated_ms(policy: Policy, shares: Mapping[tuple[int, int], int], memory: int) -> int:
    """Allocated ms from present ms per (sm_limit, memory limit) pair; `memory` is the device's
    memory in bytes, 0 when unknown (then `memory` and `max` are `cores`)."""
    if policy == "cores" or memory <= 0:
        return sum(ms * _cores(sm) for (sm, _), ms in shares.items()) // 100
    if policy == "memory":
        return sum(ms * min(lim, memory) for (_, lim), ms in shares.items()) // memory
    num = sum(
        ms * max(_cores(sm) * memory, 100 * min(lim, memory)) for (sm, lim), ms in shares.items()
    )
    return num // (100 * memory)


def used_ms(sm_percent_ms: int, memory_byte_ms: int, memory: int) -> int:
    """Used ms: the larger of SM time and memory share (only with a known device memory)."""
    sm = sm_percent_ms // 100
    if memory <= 0:
        return sm
    return max(sm, memory_byte_ms // memory)


def fit(values: Sequence[int], observed: int) -> tuple[list[int], bool]:
    """`values` scaled down to add up to `observed` when they exceed it; True when they did."""
    total = sum(values)
    if total <= observed:
        return list(values), False
    scaled = []
    rems = []
    for i, v in enumerate(values):
        q, r = divmod(v * observed, total)
        scaled.append(q)
        rems.append((-r, i))
    short = observed - sum(scaled)
    for _, i in sorted(rems)[:short]:
        scaled[i] += 1
    return scaled, True


def idle_part(alloc: Sequence[int], idle: Sequence[int], raw: Sequence[int]) -> list[int]:
    """The reserved-but-idle part of each allocation `alloc` (after `fit`): `idle` of its
    unscaled `raw`, in proportion, rounded down; `idle` itself when nothing was scaled."""
    return [a * i // r if r else 0 for a, i, r in zip(alloc, idle, raw, strict=True)]


def observed_ms(intervals: Sequence[Sequence[int]]) -> int:
    """Length of the union of [a, b) intervals."""
    total = 0
    end = None
    for a, b in sorted((iv[0], iv[1]) for iv in intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total
