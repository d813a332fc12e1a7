"""Two `lr sync` processes stream the same source (they share its sessions) while the application
swaps a UNIQUE column's values in a federated table and transmits, in the same transactions, for
three clients; one `lr sync` is SIGKILLed mid-stream, a full sync is asked and a third `lr sync`
joins meanwhile. Every
sink's table equals the source's; every message reaches each sink once, in order; the survivor
and the newcomer say no traceback (a stream used to log one when its housekeeping handed back the
last session it held, as when a newcomer takes its share)."""

from __future__ import annotations

import random
import signal
import time

import pytest

from airflow_provider_lr import cli
from tests.cli.test_cli_sync_members import CLIENTS, Writers, lr_sync, stop, streaming, topology_file
from tests.support.session import queue, wait_for
from tests.support.tables import federate, rows, swap_unique

ITEMS = 20


class SwappingWriters(Writers):
    """The clients' writers, client c0's transactions also swapping ``u`` between two rows of
    ``public.items``."""

    pause = 0.005

    def __init__(self, source) -> None:
        super().__init__(source)
        self.rngs = {c: random.Random(c) for c in CLIENTS}

    def change(self, cur, client: str, n: int) -> None:
        if client == "c0":
            swap_unique(cur, "public.items", *sorted(self.rngs[client].sample(range(1, ITEMS + 1), 2)), f"n{n}")

    def logs(self, sink, client: str) -> list[int]:
        return [int(p.split(":")[1]) for kind, p in queue(sink, "site-a", client=client) if kind == "log"]


@pytest.mark.slow
def test_two_lr_sync_one_killed_and_a_full_sync_asked_while_a_unique_column_is_swapped(lr_sites, tmp_path, monkeypatch):
    source, *sinks = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    source.query(
        "CREATE TABLE public.items (id int PRIMARY KEY, u int NOT NULL UNIQUE, n int NOT NULL DEFAULT 0, nonkey text)"
    )
    source.query("INSERT INTO public.items (id, u) SELECT g, g FROM generate_series(1, %s) g", (ITEMS,))
    federate(source, "public.items", client="c0")
    first, second = lr_sync(topo, tmp_path / "first.log"), lr_sync(topo, tmp_path / "second.log")
    try:
        wait_for(lambda: streaming(source) == 6, 60, "every session streaming")
        with SwappingWriters(source) as writers:
            time.sleep(1.0)
            first.send_signal(signal.SIGKILL)
            first.wait()
            assert cli.main(["full-sync", "--topology", topo, "--sink", "site-c", "--client", "c1"]) == 0
            third = lr_sync(topo, tmp_path / "third.log")  # joins: the survivor hands it a share
            time.sleep(2.0)
        wait_for(
            lambda: all(rows(s, "public.items") == rows(source, "public.items") for s in sinks)
            and all(writers.logs(s, c)[-1:] == [writers.sent[c]] for s in sinks for c in CLIENTS),
            30,
            "the tables and the last message at both sinks",
        )
        assert second.poll() is None and third.poll() is None, "the survivor and the newcomer still stream"
    finally:
        stop(first, second, *([third] if "third" in locals() else []))
    for sink in sinks:
        for client in CLIENTS:
            got = writers.logs(sink, client)
            if (sink.site_id, client) == ("site-c", "c1"):  # the full sync's base replaced the entries before it
                assert got == sorted(set(got)), "once and in order"
            else:
                assert got == list(range(1, writers.sent[client] + 1)), (sink.site_id, client)
    for log in ("second.log", "third.log"):
        assert "Traceback" not in (tmp_path / log).read_text(), log
