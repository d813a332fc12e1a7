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
* **Around a cut.** A session whose sink its member says it cannot reach (``cut``: a stalled link,
  a firewall between that member and the sink) goes to the heaviest of the source's members that
  can, when one can: a member cut off from a sink no longer keeps its sessions while one beside it
  reaches the sink. When none can, the share stands (its cycles report the sink's errors).
* **Stable**: rendezvous (highest-random-weight) hashing. Each (unit, member) pair has a weight;
  pairs are taken heaviest first, a member taking a unit while under its share. On one source a
  member that joins or leaves moves its own share and at most half a share more (the shares shift
  by one); with several sources a change in how many members read a source can move a source's
  sessions more, never a reshuffle of all (``tests/engine/session/test_assignment.py``). Fewer
  moves would take the previous assignment as an input (Kafka's sticky assignors), so members
  that read it at different moments could disagree for longer; a move costs a lease hand-over.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence

from airflow_provider_lr.engine.vocabulary import SessionKey


def weight(unit: str, member: str) -> int:
    """The rendezvous weight of ``unit`` at ``member``: the same on every machine and run."""
    return int.from_bytes(hashlib.blake2b(f"{unit}\x00{member}".encode(), digest_size=8).digest(), "big")


def assign(
    sessions: Iterable[SessionKey],
    members: Mapping[str, Sequence[str]],
    cut: Mapping[str, Mapping[str, Collection[str]]] | None = None,
) -> dict[str, list[SessionKey]]:
    """member → its sessions (sorted), for every member named in ``members`` (source → the live
    members that reach it); ``cut``: source → member → the sites that member says (at that source)
    it cannot reach now. A session whose source has no live member is nobody's."""
    by_source: dict[str, list[SessionKey]] = {}
    for key in sorted(set(sessions)):
        if members.get(key.source):
            by_source.setdefault(key.source, []).append(key)
    out: dict[str, list[SessionKey]] = {m: [] for m in sorted({m for ms in members.values() for m in ms})}
    eligible = {source: sorted(set(members[source])) for source in by_source}
    for source, readers in _readers(by_source, eligible).items():
        named = {str(k): k for k in by_source[source]}
        shares = _Shares(readers, len(named))
        owner: dict[str, str] = {}
        for name, member in _heaviest_first(dict.fromkeys(named, readers)):
            if name not in owner and shares.take(member):
                owner[name] = member
        unreached = (cut or {}).get(source, {})
        for name, member in owner.items():
            key = named[name]
            if key.sink in unreached.get(member, ()):
                reach = [m for m in sorted(set(members[source])) if key.sink not in unreached.get(m, ())]
                member = max(reach, key=lambda m: (weight(name, m), m)) if reach else member
            out[member].append(key)
    return {m: sorted(keys) for m, keys in out.items()}


def _readers(by_source: Mapping[str, list[SessionKey]], eligible: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """source → the members reading it. How many: one each; when members outnumber sources, the
    others one by one to the source with the most sessions per reader so far (never more readers
    than sessions, or than members reaching it). Which: heaviest (source, member) pairs first, a
    member up to its share of all the readings."""
    everyone = sorted({m for ms in eligible.values() for m in ms})
    wanted = dict.fromkeys(by_source, 1)
    for _ in range(len(everyone) - len(by_source)):
        room = [s for s in by_source if wanted[s] < min(len(by_source[s]), len(eligible[s]))]
        if not room:
            break
        wanted[max(room, key=lambda s: (len(by_source[s]) / wanted[s], s))] += 1
    shares = _Shares(everyone, sum(wanted.values()))
    readers: dict[str, list[str]] = {s: [] for s in by_source}
    pairs = _heaviest_first(eligible)
    for source, member in pairs:
        if len(readers[source]) < wanted[source] and shares.take(member):
            readers[source].append(member)
    for source, member in pairs:  # a source whose members are all full: its heaviest one reads it too
        if not readers[source]:
            readers[source].append(member)
    return {s: sorted(ms) for s, ms in readers.items()}


def _heaviest_first(candidates: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
    """(unit, member) pairs of unit → its candidate members, by rendezvous weight, heaviest first
    (ties by name: deterministic)."""
    pairs = sorted(
        ((weight(u, m), u, m) for u, members in candidates.items() for m in members), key=lambda p: (-p[0], p[1], p[2])
    )
    return [(u, m) for _, u, m in pairs]


class _Shares:
    """Each member's share of ``units`` things: ``units // len(members)``, one more for the first
    ``units % len(members)`` members to reach that many (so shares differ by at most one)."""

    def __init__(self, members: Sequence[str], units: int) -> None:
        self.base, self.extra = divmod(units, len(members))
        self.load = dict.fromkeys(members, 0)

    def take(self, member: str) -> bool:
        """One more for ``member`` if its share has room."""
        load = self.load[member]
        if load < self.base or (load == self.base and self.extra > 0):
            self.extra -= load == self.base
            self.load[member] += 1
            return True
        return False
