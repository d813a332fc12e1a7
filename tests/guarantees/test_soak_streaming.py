"""The soak in the default mode: `lr sync` streams (its default), and everything users do around it
happens at random, with a seed.

An application on site-a increments per-sink counters and transmits each increment (a payload unique
in the run) to the sinks it counted for; in the same transactions it swaps the values of a UNIQUE
column between two rows of a federated table and, now and then, sets a row of another federated
table that has a column of every built-in type to odd values (NaN, infinities, NULLs, arrays,
composites, TOAST-sized text). Streaming replicators run in their own processes, as `lr sync` does.
Meanwhile a chaos loop asks full syncs (one, or back to back for one sink or both), SIGKILLs a
streaming replicator (a successor takes over once its lease runs out), runs two replicators at
once, restarts a sink server, and trims the log. Then site-a fails over to site-b (a planned
switchover), the application carries on at site-b, the chaos goes on, and site-a rejoins as a sink.

After each phase a clean replicator drains everything; then every sink's replay of its receive
queue equals its source's counters (nothing lost or doubled), no unique payload reached a sink's
queue as a log entry twice (across full syncs too: a full sync never sets a sink back), every site
holds the same federated tables (each value compared), and no full-sync request is left open.

Knobs: ``LR_SOAK_SEED`` (default 11; ``random`` for a fresh one), ``LR_STREAM_SOAK_SECONDS`` (chaos
seconds before the failover, default 15 in CI; a third as long after it), ``LR_SOAK_RATE``
(transactions/s, default 150), ``LR_SOAK_REPORT`` (summary as JSON there).
``pytest tests/guarantees/test_soak_streaming.py -s`` prints the summary.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg2
import pytest

from airflow_provider_lr.engine.session.settings import StreamSettings
from airflow_provider_lr.engine.site import failover
from airflow_provider_lr.engine.source import full_sync, trim
from tests.support.session import apply, queue
from tests.support.soak import (
    CLIENT,
    SINKS,
    SOURCE,
    TABLE_DDL,
    Writer,
    compare,
    drain,
    expire_leases,
    kill,
    prepare_sites,
    replay,
    source_counters,
    spawn_runner,
)
from tests.support.tables import (
    TYPES,
    TYPES_DDL,
    every_type_table,
    federate,
    insert_every_type,
    rows,
    swap_unique,
    type_differences,
)

# leases that run out fast after a kill; small batches (more boundaries); a short data timeout
SETTINGS = {"lease_seconds": 1.5, "max_entries": 500, "data_timeout": 10.0, "barrier_timeout": 2.0}
CHAOS_SECONDS = float(os.environ.get("LR_STREAM_SOAK_SECONDS", "15"))
STREAM_FOR = 3600.0  # a streaming replicator runs until killed
ACTIONS = {  # action -> weight
    "full_sync": 10,
    "back_to_back": 15,
    "kill_streamer": 20,
    "two_replicators": 10,
    "restart_sink": 8,
    "trim": 10,
    "quiet": 15,
}
DEFAULT_SEED = 11
LARGE_PROVIDER = "tests.support.soak:large_counters_provider"  # supplies take a while, as real ones do


def _seed() -> int:
    raw = os.environ.get("LR_SOAK_SEED", "")
    if raw == "random":
        return random.SystemRandom().randrange(1, 2**31)
    return int(raw) if raw else DEFAULT_SEED


ITEMS = 30
ITEMS_DDL = (
    "CREATE TABLE public.soak_items (id int PRIMARY KEY, u int NOT NULL UNIQUE, n int NOT NULL DEFAULT 0, "
    "nonkey text)"
)  # (a column named like a word of the capture trigger's)


def prepare_tables(sites) -> None:
    """The federated tables at site-a (their types at every site: lr creates tables, not types)."""
    source = sites[0]
    for site in sites:
        for ddl in TYPES_DDL:
            site.query(ddl)
    source.query(ITEMS_DDL)
    source.query("INSERT INTO public.soak_items (id, u) SELECT g, g FROM generate_series(1, %s) g", (ITEMS,))
    every_type_table(source, "soak_types")
    insert_every_type(source, "soak_types", 1)
    federate(source, "public.soak_items")
    federate(source, "public.soak_types")


def table_work(cur, rng: random.Random) -> None:
    """A swap of ``u`` between two rows (three statements, the UNIQUE constraint holding after each:
    a sink that applies them in another order refuses them), and now and then a row of every type
    set to odd values or NULLs (the TOAST-sized ones rarely)."""
    a, b = rng.sample(range(1, ITEMS + 1), 2)
    swap_unique(cur, "public.soak_items", a, b, "swapped")
    if rng.random() < 0.05:
        which = rng.choice((2, 3))
        sets = ", ".join(
            f"{col} = ({t[which]})::{kind}" if rng.random() < 0.85 else f"{col} = NULL"
            for t in TYPES
            for col, kind in [t[:2]]
            if col not in ("big", "bigb") or rng.random() < 0.1
        )
        cur.execute(f"UPDATE public.soak_types SET {sets} WHERE id = {rng.choice((1, 2, 3))}")  # no parameters: no %


def table_failures(sites) -> list[str]:
    """Every site holds what the first one (the source) holds: the swaps' table by text, the table of
    every type value by value (IS NOT DISTINCT FROM)."""
    source, *others = sites
    out = []
    for site in others:
        if rows(site, "public.soak_items") != rows(source, "public.soak_items"):
            out.append(f"{site.site_id}: public.soak_items differs from {source.site_id}'s")
        out += [f"{site.site_id}: soak_types {d}" for d in type_differences(source, site, "soak_types")[:5]]
    return out


class StreamChaos:
    def __init__(self, rng: random.Random, sites, site_manager, topo, tmp_path: Path, source, sinks) -> None:
        self.rng, self.sites, self.site_manager, self.topo = rng, sites, site_manager, topo
        self.source, self.sinks = source, tuple(sinks)
        self.log = tmp_path / "streamers.log"
        self.faults: Counter[str] = Counter()
        self.serial = 0
        self.streamers: list = []

    def spawn(self) -> None:
        self.serial += 1
        self.streamers.append(
            spawn_runner(
                self.topo,
                self.sites,
                f"stream-soak-{self.serial}",
                SETTINGS,
                cycles=0,
                log_path=self.log,
                stream=STREAM_FOR,
                check_interval=StreamSettings().check_interval,
            )
        )

    def _request(self, sink: str) -> None:
        conn = self.source.connect()
        try:
            full_sync.request_full_sync(conn, sink, CLIENT, "stream soak", forced=True)
        finally:
            conn.close()

    # --- actions ---------------------------------------------------------------------------
    def full_sync(self) -> None:
        self._request(self.rng.choice(self.sinks))
        self.faults["full_sync"] += 1

    def back_to_back(self) -> None:
        """Two or three requests within ~50 ms: for one sink (the newer cancels the older), or both."""
        sinks = [self.rng.choice(self.sinks)] * 2 if self.rng.random() < 0.5 else list(self.sinks)
        if self.rng.random() < 0.3:
            sinks.append(self.rng.choice(self.sinks))
        for sink in sinks:
            self._request(sink)
            time.sleep(self.rng.uniform(0.0, 0.05))
        self.faults["back_to_back"] += 1

    def kill_streamer(self) -> None:
        victim = self.streamers.pop(0) if self.streamers else None
        if victim is not None and kill(victim):
            self.faults["kill_streamer"] += 1
        if self.rng.random() < 0.5:
            expire_leases(self.source)  # else the lease runs out by itself
        self.spawn()

    def two_replicators(self) -> None:
        """A second streaming replicator races for the sessions, then one of the two is killed."""
        self.spawn()
        time.sleep(self.rng.uniform(0.5, 3.0))
        victim = self.streamers.pop(self.rng.randrange(len(self.streamers)))
        kill(victim)
        self.faults["two_replicators"] += 1

    def restart_sink(self) -> None:
        site_id = self.rng.choice(self.sinks)
        self.site_manager.down([site_id], mode="immediate")
        time.sleep(self.rng.uniform(0.0, 1.5))
        self.site_manager.up(site_ids=[site_id])
        self.faults["restart_sink"] += 1

    def trim(self) -> None:
        conn = self.source.connect()
        try:
            trim.safe_trim(conn)
        finally:
            conn.close()
        self.faults["trim"] += 1

    def quiet(self) -> None:
        time.sleep(self.rng.uniform(0.2, 1.5))

    def step(self) -> str:
        kinds = sorted(ACTIONS)
        kind = self.rng.choices(kinds, weights=[ACTIONS[k] for k in kinds])[0]
        getattr(self, kind)()
        time.sleep(self.rng.uniform(0.1, 1.0))
        return kind

    def run(self, seconds: float, midway: Callable[[], None] | None = None) -> list[str]:
        """Chaos for ``seconds`` with a streaming replicator running; ``midway`` once half-way."""
        steps: list[str] = []
        self.spawn()
        start = time.monotonic()
        while time.monotonic() < start + seconds:
            steps.append(self.step())
            if midway is not None and time.monotonic() >= start + seconds / 2:
                midway()
                midway = None
        return steps

    def stop(self) -> None:
        for proc in self.streamers:
            kill(proc)
        self.streamers.clear()
        down = [s.site_id for s in self.sites if not self.site_manager.is_running(s.server)]
        if down:
            self.site_manager.up(site_ids=down)


def check_phase(phase: str, topo, sites, source, sinks, writer: Writer, summary: dict) -> list[str]:
    """Drain with a clean replicator, then the invariants of one phase (its source and sinks)."""
    expire_leases(source)
    drained, reports, rounds = drain(topo, sites, SETTINGS, timeout=180)
    failures: list[str] = []
    if not drained:
        failures.append(
            f"{phase}: sessions never settled: "
            + "; ".join(f"{r.session} state={r.state} remaining={r.remaining} error={r.error!r}" for r in reports)
        )
    lost = duplicated = twice = 0
    for sink in sinks:
        truth = source_counters(source, sink.site_id)
        seen = replay(queue(sink, source.site_id, CLIENT))
        sink_lost, sink_dup, diffs = compare(truth, seen.state)
        lost, duplicated, twice = lost + sink_lost, duplicated + sink_dup, twice + len(seen.twice)
        if diffs:
            failures.append(
                f"{phase} {sink.site_id}: replay != {source.site_id}: lost {sink_lost}, duplicated "
                f"{sink_dup}: {dict(list(diffs.items())[:5])}"
            )
        if seen.twice:
            failures.append(
                f"{phase} {sink.site_id}: {len(seen.twice)} messages reached the queue twice as log "
                f"entries, e.g. {seen.twice[:3]}"
            )
    failures += [f"{phase} {f}" for f in table_failures([source, *sinks])]
    open_requests = source.query(
        "SELECT sink_site_id, status, note FROM lr.full_sync_requests WHERE status IN ('pending', 'supplied')"
    )
    if open_requests:
        failures.append(f"{phase}: full-sync requests left open: {open_requests}")
    if writer.errors:
        failures.append(f"{phase}: the application's transactions failed: {writer.errors[:3]}")
    summary[phase] = {
        "transactions": writer.stats.committed,
        "messages": writer.stats.messages,
        "lost": lost,
        "duplicated": duplicated,
        "log_entries_twice": twice,
        "drain_rounds": rounds,
    }
    return failures


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(max(900, int(CHAOS_SECONDS * 3) + 600))
def test_streaming_soak_delivers_every_message_once_through_full_syncs_kills_races_and_a_failover(
    lr_sites, site_manager, tmp_path, caplog
):
    caplog.set_level(logging.ERROR, logger="airflow_provider_lr")
    seed = _seed()
    rate = float(os.environ.get("LR_SOAK_RATE", "150"))
    print(
        f"\nstreaming soak: seed {seed}, {CHAOS_SECONDS:.0f}s of chaos then {CHAOS_SECONDS / 3:.0f}s after a "
        f"failover, {rate:.0f} tx/s",
        flush=True,
    )
    rng = random.Random(seed)
    site_a, site_b, site_c = lr_sites
    dsns = {s.site_id: s.dsn for s in lr_sites}
    prepare_sites(lr_sites)
    topo = apply(
        lr_sites,
        [{"source": SOURCE, "sinks": list(SINKS), "clients": [CLIENT]}],
        providers={CLIENT: LARGE_PROVIDER},
        settings={"lease_seconds": SETTINGS["lease_seconds"]},
    )
    prepare_tables(lr_sites)
    started = time.monotonic()
    summary: dict = {"seed": seed, "chaos_seconds": CHAOS_SECONDS}

    # --- phase 1: site-a is the source -------------------------------------------------------
    chaos = StreamChaos(rng, lr_sites, site_manager, topo, tmp_path, site_a, SINKS)
    writer = Writer(site_a, seed=rng.randrange(2**31), rate=rate, tag="a", extra=table_work).start()
    try:
        steps = chaos.run(CHAOS_SECONDS)
    finally:
        writer.stop()
        chaos.stop()
    failures = check_phase("before the failover", topo, lr_sites, site_a, [site_b, site_c], writer, summary)
    summary["faults"] = dict(sorted(chaos.faults.items()))

    # --- phase 2: a planned switchover to site-b, the application there, site-a rejoins ------
    def connect(site_id: str) -> psycopg2.extensions.connection:
        return psycopg2.connect(dsns[site_id])

    promoted = failover.promote(
        failover.FailoverRequest(SOURCE, "site-b", planned=True, reason="stream soak"), connect, topology=topo
    )
    site_b.query(TABLE_DDL)  # the application's own counters there (not replicated)
    after = StreamChaos(rng, lr_sites, site_manager, promoted.topology, tmp_path, site_b, ("site-c", SOURCE))
    writer_b = Writer(
        site_b,
        seed=rng.randrange(2**31),
        rate=rate,
        tag="b",
        extra=table_work,
        subsets=(("site-c",), (SOURCE,), ("site-c", SOURCE)),
    ).start()
    rejoined: list[str] = []
    try:
        steps += after.run(
            CHAOS_SECONDS / 3, midway=lambda: rejoined.append(failover.rejoin(SOURCE, connect, promoted.topology).site)
        )
    finally:
        writer_b.stop()
        after.stop()
    assert rejoined == [SOURCE], "site-a rejoined half-way"
    failures += check_phase(
        "after the failover", promoted.topology, lr_sites, site_b, [site_c, site_a], writer_b, summary
    )
    summary.update(
        steps=len(steps),
        faults_after=dict(sorted(after.faults.items())),
        wall_seconds=round(time.monotonic() - started, 1),
        failures=failures,
    )
    totals = {
        k: sum(summary[p][k] for p in ("before the failover", "after the failover"))
        for k in ("transactions", "lost", "duplicated", "log_entries_twice")
    }
    print(
        f"streaming soak: seed={seed} seconds={CHAOS_SECONDS:.0f}+{CHAOS_SECONDS / 3:.0f} {totals} "
        f"faults={summary['faults']} after={summary['faults_after']} tables_equal={not any('soak_' in f for f in failures)}"
        + (f" FAILED: {len(failures)}" if failures else " ok"),
        flush=True,
    )
    if os.environ.get("LR_SOAK_REPORT"):
        Path(os.environ["LR_SOAK_REPORT"]).write_text(json.dumps(summary, indent=2, default=str))
    assert not failures, (
        f"streaming soak seed {seed}:\n" + "\n".join(failures) + f"\n{json.dumps(summary, default=str)}"
    )
