"""The sites a replicator member says it cannot reach (``session/unreached``): marked when a
connection waited for nothing, kept while the probe is not answered, gone once it is; nothing is
marked in a process that shares its sessions with no other."""

from __future__ import annotations

import time

import psycopg2

from airflow_provider_lr.engine.session.unreached import Unreached


def _until(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_site_marked_cut_off_stays_so_until_the_probe_is_answered_then_is_reached_again(lr_sites):
    site = lr_sites[1]
    answering = {"now": False}

    def connect(site_id: str):
        assert site_id == site.site_id
        if not answering["now"]:
            raise psycopg2.OperationalError("timeout expired")
        return site.connect()

    marks = Unreached(connect, probe_every=0.05)
    try:
        marks.failed(site.site_id, "a connect timed out")
        assert marks() == [site.site_id] and marks.why(site.site_id) == "a connect timed out"
        time.sleep(0.3)  # several probes, none answered
        assert marks() == [site.site_id]
        answering["now"] = True
        assert _until(lambda: marks() == []), "the probe answered, the mark stayed"
        marks.failed(site.site_id, "a call gave no answer within 10 s")  # again: a new probe starts
        assert _until(lambda: marks() == [])
    finally:
        marks.close()
    alone = Unreached(connect, shared=False)
    alone.failed(site.site_id, "a connect timed out")
    assert alone() == [] and alone.why(site.site_id) is None  # nobody could take its sessions
