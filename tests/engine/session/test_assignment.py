"""Which replicator member works which session (``session/assignment``): by source where possible,
split when members outnumber sources, balanced, the same answer for every member, and few moves
when a member joins or leaves."""

from __future__ import annotations

import random

import pytest

from airflow_provider_lr.engine.session.assignment import assign
from airflow_provider_lr.engine.vocabulary import SessionKey


def sessions(sources: int, sinks: int, clients: int = 1) -> list[SessionKey]:
    return [
        SessionKey(f"src-{s}", f"sink-{k}", f"client{c}")
        for s in range(sources)
        for k in range(sinks)
        for c in range(clients)
    ]


def members(n: int, prefix: str = "host") -> list[str]:
    return [f"{prefix}-{i}:{4000 + i}:{i:08x}" for i in range(n)]


def everywhere(keys: list[SessionKey], who: list[str]) -> dict[str, list[str]]:
    return {source: list(who) for source in {k.source for k in keys}}


def owners(assignment: dict[str, list[SessionKey]]) -> dict[SessionKey, str]:
    found: dict[SessionKey, str] = {}
    for member, keys in assignment.items():
        for key in keys:
            assert key not in found, f"{key} assigned twice"
            found[key] = member
    return found


def moved(before: dict[str, list[SessionKey]], after: dict[str, list[SessionKey]]) -> int:
    old, new = owners(before), owners(after)
    return sum(1 for key in old if new.get(key) != old[key])


def test_one_member_works_every_session():
    keys = sessions(3, 4)
    assert assign(keys, everywhere(keys, ["solo"])) == {"solo": sorted(keys)}


@pytest.mark.parametrize(("n_sources", "n_members"), [(2, 2), (4, 2), (5, 3), (8, 8)])
def test_with_at_least_as_many_sources_as_members_each_source_stays_with_one_member(n_sources, n_members):
    keys = sessions(n_sources, 6)
    result = assign(keys, everywhere(keys, members(n_members)))
    readers = {k.source: {m for m, ks in result.items() if any(x.source == k.source for x in ks)} for k in keys}
    assert all(len(who) == 1 for who in readers.values()), readers
    counts = sorted(len({k.source for k in ks}) for ks in result.values())
    assert counts[-1] - counts[0] <= 1, f"sources per member {counts}"
    assert set(owners(result)) == set(keys)


@pytest.mark.parametrize(("n_sources", "n_members"), [(1, 2), (1, 5), (2, 3), (3, 7)])
def test_with_more_members_than_sources_a_source_is_shared_and_every_member_works(n_sources, n_members):
    keys = sessions(n_sources, 12)
    result = assign(keys, everywhere(keys, members(n_members)))
    assert set(owners(result)) == set(keys)
    assert all(result[m] for m in members(n_members)), "a member left idle"
    assert all(len({k.source for k in ks}) == 1 for ks in result.values()), "one source per member"
    for source in {k.source for k in keys}:
        loads = sorted(len([k for k in ks if k.source == source]) for ks in result.values() if ks[0].source == source)
        assert loads[-1] - loads[0] <= 1, f"{source}: sessions per member {loads}"


def test_a_larger_source_gets_more_of_the_members():
    keys = sessions(1, 24) + [SessionKey("src-1", f"sink-{k}", "client0") for k in range(4)]
    result = assign(keys, everywhere(keys, members(5)))
    sharing = {
        source: sum(1 for ks in result.values() if ks and ks[0].source == source) for source in ("src-0", "src-1")
    }
    assert sharing == {"src-0": 4, "src-1": 1}
    assert sorted(len(ks) for ks in result.values()) == [4, 6, 6, 6, 6]


def test_every_member_computes_the_same_answer_whatever_the_order_it_reads():
    keys = sessions(2, 7, 2)
    who = members(3)
    first = assign(keys, everywhere(keys, who))
    rng = random.Random(7)
    for _ in range(5):
        shuffled_keys, shuffled_members = keys[:], who[:]
        rng.shuffle(shuffled_keys)
        rng.shuffle(shuffled_members)
        assert assign(shuffled_keys, everywhere(keys, shuffled_members)) == first


def test_a_member_that_does_not_reach_a_source_gets_none_of_its_sessions():
    keys = sessions(2, 4)
    a, b = members(2)
    result = assign(keys, {"src-0": [a, b], "src-1": [a]})
    assert all(k.source == "src-0" for k in result[b])
    assert {k for k in keys if k.source == "src-1"} <= set(result[a])
    assert assign(keys, {"src-0": [a]}) == {a: [k for k in sorted(keys) if k.source == "src-0"]}  # src-1: nobody's


@pytest.mark.parametrize("per_source", [12, 24, 60])
def test_a_member_joining_or_leaving_one_source_moves_about_its_own_share(per_source):
    """Rendezvous hashing: a join moves what the newcomer takes (and a few more as the shares
    shift by one), a leave what the leaver had (and as few more)."""
    keys = sessions(1, per_source)
    for n in range(1, 6):
        before = assign(keys, everywhere(keys, members(n)))
        after = assign(keys, everywhere(keys, members(n + 1)))
        newcomer, leaver = members(n + 1)[-1], members(n + 1)[0]
        slack = per_source // (n + 1) // 2 + 1  # half a share
        assert len(after[newcomer]) <= moved(before, after) <= len(after[newcomer]) + slack, n
        left = assign(keys, everywhere(keys, [m for m in members(n + 1) if m != leaver]))
        assert len(after[leaver]) <= moved(after, left) <= len(after[leaver]) + slack, n


@pytest.mark.parametrize(("n_sources", "per_source"), [(2, 12), (3, 20), (6, 4)])
def test_a_member_joining_or_leaving_several_sources_never_reshuffles_them(n_sources, per_source):
    """With several sources a join or leave can also change how many members read a source, which
    moves more than the member's own share; still, most of what need not move stays (hashing the
    sessions modulo the member count would move nearly everything)."""
    keys = sessions(n_sources, per_source)
    for n in range(1, 8):
        before = assign(keys, everywhere(keys, members(n)))
        after = assign(keys, everywhere(keys, members(n + 1)))
        newcomer, leaver = members(n + 1)[-1], members(n + 1)[0]
        assert moved(before, after) - len(after[newcomer]) <= len(keys) // 2, n
        left = assign(keys, everywhere(keys, [m for m in members(n + 1) if m != leaver]))
        assert moved(after, left) - len(after[leaver]) <= len(keys) // 2, n


def test_one_member_more_on_a_source_of_24_sessions_moves_little():
    """The seed shape: one source, 24 sinks; three members, then a fourth: it takes its 6, and
    of the others only one hands a session more over."""
    keys = sessions(1, 24)
    three = assign(keys, everywhere(keys, members(3)))
    four = assign(keys, everywhere(keys, members(4)))
    assert sorted(len(v) for v in four.values()) == [6, 6, 6, 6]
    assert moved(three, four) == 7


def test_a_member_cut_off_from_a_sink_gives_that_sinks_sessions_to_a_member_that_reaches_it():
    """A member says it cannot reach site-x (a stalled link): every session to site-x goes to a member
    that reaches it, the other sessions stay where they were; when every member is cut off from it,
    the share stands (someone keeps trying and reporting)."""
    sessions = [SessionKey("site-a", sink, f"c{i}") for sink in ("site-x", "site-y") for i in range(6)]
    members = {"site-a": ["m1", "m2", "m3"]}
    before = assign(sessions, members)
    after = assign(sessions, members, {"site-a": {"m1": ("site-x",)}})
    assert not [k for k in after["m1"] if k.sink == "site-x"]
    assert sorted(k for ks in after.values() for k in ks) == sorted(sessions)
    moved = {k for k in before["m1"] if k.sink == "site-x"}
    assert moved and all((k in after["m2"] or k in after["m3"]) for k in moved)
    assert all(k in after[m] for m, ks in before.items() for k in ks if k not in moved)
    everyone = {"site-a": {m: ("site-x",) for m in ("m1", "m2", "m3")}}
    assert assign(sessions, members, everyone) == before
    assert assign(sessions, members, {"site-b": {"m1": ("site-x",)}}) == before  # said at another source
