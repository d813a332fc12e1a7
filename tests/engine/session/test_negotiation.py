"""Negotiation rules, one row each (reference/corfu_lr.md A3, adapted to commit positions)."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine.session.negotiation import Decision, SinkView, SourceView, negotiate

T = "topo-1"


def sink(started=-1, transferred=-1, applied=-1, last=-1, consistent=False, topo=T) -> SinkView:
    return SinkView(topo, started, transferred, applied, last, consistent)


CASES = [
    # (name, source view, sink view, decision, resume_from)
    ("topology ids differ", SourceView("topo-2"), sink(10, 10, 10, 12, True), Decision.REFUSE, -1),
    ("sink has no topology", SourceView(T), sink(topo=None), Decision.REFUSE, -1),
    ("source has no topology", SourceView(None), sink(), Decision.REFUSE, -1),
    ("first contact", SourceView(T), sink(), Decision.SNAPSHOT_SYNC, -1),
    ("transfer interrupted", SourceView(T), sink(10, -1, -1), Decision.SNAPSHOT_SYNC, -1),
    ("transfer interrupted, older snapshot applied", SourceView(T), sink(20, 10, 10, 15), Decision.SNAPSHOT_SYNC, -1),
    ("transferred, apply pending", SourceView(T), sink(10, 10, -1), Decision.WAIT_SNAPSHOT_APPLY, -1),
    ("transferred, older snapshot applied", SourceView(T), sink(20, 20, 10, 15), Decision.WAIT_SNAPSHOT_APPLY, -1),
    ("applied, nothing since", SourceView(T), sink(10, 10, 10, 10, True), Decision.LOG_ENTRY_SYNC, 10),
    ("applied, deltas since", SourceView(T, trim_mark=5), sink(10, 10, 10, 42, True), Decision.LOG_ENTRY_SYNC, 42),
    (
        "trim exactly at the sink's position",
        SourceView(T, trim_mark=42),
        sink(10, 10, 10, 42, True),
        Decision.LOG_ENTRY_SYNC,
        42,
    ),
    ("trimmed past the sink", SourceView(T, trim_mark=43), sink(10, 10, 10, 42, True), Decision.SNAPSHOT_SYNC, -1),
    ("forced full sync", SourceView(T, forced_full_sync=True), sink(10, 10, 10, 42, True), Decision.SNAPSHOT_SYNC, -1),
    ("forced beats apply pending", SourceView(T, forced_full_sync=True), sink(10, 10, -1), Decision.SNAPSHOT_SYNC, -1),
    ("applied but not consistent", SourceView(T), sink(10, 10, 10, 10, False), Decision.SNAPSHOT_SYNC, -1),
    ("last processed below the base", SourceView(T), sink(10, 10, 10, 5, True), Decision.SNAPSHOT_SYNC, -1),
]


@pytest.mark.parametrize("name, source, sink_view, decision, resume", CASES, ids=[c[0] for c in CASES])
def test_negotiation_rule(name, source, sink_view, decision, resume):
    result = negotiate(source, sink_view)
    assert result.decision is decision, result.reason
    assert result.resume_from == resume
    assert result.reason


def test_refusal_names_both_ids():
    result = negotiate(SourceView("aaa"), sink(topo="bbb"))
    assert "aaa" in result.reason and "bbb" in result.reason
