"""The topology's durability rule checked against its sites (DistributedLog's
region-aware placement): "there is no combination of nodes that would satisfy the ack quorum with
less than minRegionsForDurability responses [regions]".

For each source, the sites an entry can be stored on are the source and its sinks, grouped by
region. An entry is written to ``write_quorum`` of them (default: all) and counts as durable once
``ack_quorum`` hold it (default: ``write_quorum``). The rule is refused when

* the sites span fewer regions than ``min_regions_for_durability`` (the minimum is unreachable),
  or the quorums do not fit the sites (``write_quorum`` above the sites there are, ``ack_quorum``
  above ``write_quorum``);
* the ack quorum could be met in fewer regions. The worst case is degraded placement: only
  ``min_regions`` regions are up and the ``write_quorum`` copies are spread over them as evenly as
  their sites allow (as the placement policy does); the ``min_regions - 1`` fullest of them must
  not hold ``ack_quorum`` copies. The seed's example, 3 regions of 20 sites, ``min_regions`` 2 and
  ``write_quorum`` 15: with one region down, 15 copies over 2 regions put 8 in one of them, so an
  ack quorum of 8 could be met in a single region (refused); 9 cannot (accepted).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import combinations


@dataclass(frozen=True)
class RuleProblem:
    key: str  # the durability key at fault
    message: str


def spread(copies: int, capacities: list[int]) -> list[int] | None:
    """``copies`` spread over regions as evenly as their ``capacities`` allow (water filling); None
    when they do not fit."""
    if copies > sum(capacities):
        return None
    shares = [0] * len(capacities)
    left = copies
    while left:
        open_ = [i for i, cap in enumerate(capacities) if shares[i] < cap]
        for i in sorted(open_, key=lambda i: shares[i]):  # one more each, emptiest first
            if not left:
                break
            shares[i] += 1
            left -= 1
    return shares


def worst_degraded_quorum(
    sites_per_region: dict[str, int], min_regions: int, write_quorum: int
) -> tuple[int, tuple[str, ...]]:
    """The most copies that ``min_regions - 1`` regions can hold when only ``min_regions`` regions
    are up and the write quorum is spread evenly over them; and the regions up in that case."""
    worst = 0
    where: tuple[str, ...] = ()
    names = sorted(sites_per_region)
    for up in combinations(names, min(min_regions, len(names))):
        shares = spread(write_quorum, [sites_per_region[r] for r in up])
        if shares is None:
            continue  # the write quorum cannot be placed with only these regions up: no write, no ack
        held = sum(sorted(shares, reverse=True)[: min_regions - 1])
        if held > worst:
            worst, where = held, up
    return worst, where


def check_rule(
    site_regions: dict[str, str], min_regions: int, ack_quorum: int | None = None, write_quorum: int | None = None
) -> RuleProblem | None:
    """The first problem of the rule for one source and its sinks (``site_regions``: site -> region,
    the source included), or None."""
    per_region = Counter(site_regions.values())
    sites = len(site_regions)
    write = write_quorum if write_quorum is not None else sites
    ack = ack_quorum if ack_quorum is not None else write
    if min_regions > len(per_region):
        return RuleProblem(
            "min_regions_for_durability",
            f"{min_regions} regions can never be reached: the sites span only {len(per_region)} "
            f"({dict(sorted(per_region.items()))})",
        )
    if write > sites:
        return RuleProblem("write_quorum", f"write_quorum {write} exceeds the {sites} sites there are")
    if ack > write:
        return RuleProblem("ack_quorum", f"ack_quorum {ack} exceeds write_quorum {write}")
    if min_regions <= 1:
        return None
    worst, up = worst_degraded_quorum(dict(per_region), min_regions, write)
    if ack <= worst:
        return RuleProblem(
            "ack_quorum",
            f"ack_quorum {ack} could be met in fewer than {min_regions} regions: with only {list(up)} up, "
            f"write_quorum {write} spread over them puts {worst} copies in {min_regions - 1} region(s); "
            f"raise ack_quorum above {worst} (or lower write_quorum)",
        )
    return None
