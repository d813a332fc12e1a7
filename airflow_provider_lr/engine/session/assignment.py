"""Which replicator member works which session: a pure function of the live members and the sessions.

Every member computes the same answer from the same view (members sorted, weights from a hash of
names, no randomness, no clocks), so no coordinator decides and nothing is stored: each member
works its share and the leases (fenced by epoch) settle any moment when two views differ.

* **By source where possible.** A source's sessions stay together when there are at least as many
  sources as members, so a member reads each of its sources once (one reader per source).
* **Split when members outnumber sources.** Every source gets a member; the others go, one by one,
  to the source with the most sessions per member so far, and that source's sessions are shared
  between its members.
* **Balanced**: counts (of sources, of a source's sessions) differ by at most one between members,
  unless only some members reach a source.
* **Stable**: rendezvous (highest-random-weight) hashing. Each (unit, member) pair has a weight;
  pairs are taken heaviest first, a member taking a unit while under its share. A member that
  joins or leaves moves about its own share of the units; the others mostly keep theirs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

from airflow_provider_lr.engine.vocabulary import SessionKey


def weight(unit: str, member: str) -> int:
    """The rendezvous weight of ``unit`` at ``member``: the same on every machine and run."""
    return int.from_bytes(hashlib.blake2b(f"{unit}\x00{member}".encode(), digest_size=8).digest(), "big")


def assign(sessions: Iterable[SessionKey], members: Mapping[str, Sequence[str]]) -> dict[str, list[SessionKey]]:
    """member → its sessions (sorted), for every member named in ``members`` (source → the live
    members that reach it). A session whose source has no live member is nobody's."""
    by_source: dict[str, list[SessionKey]] = {}
    for key in sorted(set(sessions)):
        if members.get(key.source):
            by_source.setdefault(key.source, []).append(key)
    everyone = sorted({m for source in by_source for m in members[source]})
    out: dict[str, list[SessionKey]] = {m: [] for m in sorted({m for ms in members.values() for m in ms})}
    if not everyone:
        return out
    eligible = {source: sorted(set(members[source])) for source in by_source}
    if len(by_source) >= len(everyone):
        owners = _spread(sorted(by_source), everyone, eligible)
        for source, member in owners.items():
            out[member].extend(by_source[source])
    else:
        for source, sharing in _shares(by_source, eligible, everyone).items():
            keys = {str(k): k for k in by_source[source]}
            for name, member in _spread(sorted(keys), sharing).items():
                out[member].append(keys[name])
    return {m: sorted(keys) for m, keys in out.items()}


def _spread(units: list[str], members: list[str], eligible: Mapping[str, list[str]] | None = None) -> dict[str, str]:
    """unit → member: heaviest pairs first, each member up to its share (``len(units) // len(members)``,
    one more for the first ``len(units) % len(members)`` members to reach it). ``eligible``: the
    members that may take each unit (default: all); a unit left over because all of its eligible
    members are full goes to its heaviest eligible one."""
    base, extra = divmod(len(units), len(members))
    pairs = sorted(
        ((weight(u, m), u, m) for u in units for m in (members if eligible is None else eligible[u])),
        key=lambda p: (-p[0], p[1], p[2]),
    )
    owner: dict[str, str] = {}
    load = dict.fromkeys(members, 0)
    for _, unit, member in pairs:
        if unit in owner:
            continue
        if load[member] < base or (load[member] == base and extra > 0):
            extra -= load[member] == base
            owner[unit] = member
            load[member] += 1
    for _, unit, member in pairs:  # heaviest first: the first pair of a unit left over
        owner.setdefault(unit, member)
    return owner


def _shares(
    by_source: Mapping[str, list[SessionKey]], eligible: Mapping[str, list[str]], everyone: list[str]
) -> dict[str, list[str]]:
    """source → the members sharing it, when members outnumber sources: how many each source gets
    (one each, then the rest one by one to the most sessions per member, never more members than
    sessions or than reach it), then which ones (heaviest (source, member) pairs first, one source
    per member)."""
    wanted = dict.fromkeys(by_source, 1)
    for _ in range(len(everyone) - len(by_source)):
        room = [s for s in by_source if wanted[s] < min(len(by_source[s]), len(eligible[s]))]
        if not room:
            break
        most = max(room, key=lambda s: (len(by_source[s]) / wanted[s], s))
        wanted[most] += 1
    pairs = sorted(
        ((weight(s, m), s, m) for s in by_source for m in eligible[s]),
        key=lambda p: (-p[0], p[1], p[2]),
    )
    sharing: dict[str, list[str]] = {s: [] for s in by_source}
    taken: set[str] = set()
    for _, source, member in pairs:
        if member not in taken and len(sharing[source]) < wanted[source]:
            sharing[source].append(member)
            taken.add(member)
    for _, source, member in pairs:  # a source no free member reaches: its heaviest one takes it too
        if not sharing[source]:
            sharing[source].append(member)
    return {s: sorted(ms) for s, ms in sharing.items()}
