"""The soak in the default mode: `lr sync` streams (its default), and everything users do around it
happens at random, with a seed.

An application on site-a increments per-sink counters and transmits each increment (a payload unique
in the run) to the sinks it counted for. Streaming replicators run in their own processes, as
`lr sync` does. Meanwhile a chaos loop asks full syncs (one, or back to back for one sink or both),
SIGKILLs a streaming replicator (a successor takes over once its lease runs out), runs two
replicators at once, restarts a sink server, and trims the log. Afterwards a clean replicator
drains everything; then every sink's replay of its receive queue equals the source's counters
(nothing lost or doubled), no unique payload reached a sink's queue as a log entry twice (across
full syncs too: a full sync never sets a sink back), and no full-sync request is left open.

Knobs: ``LR_SOAK_SEED`` (default 11; ``random`` for a fresh one), ``LR_STREAM_SOAK_SECONDS`` (chaos
seconds, default 20 in CI), ``LR_SOAK_RATE`` (transactions/s, default 150), ``LR_SOAK_REPORT``
(summary as JSON there). ``pytest tests/engine/test_soak_streaming.py -s`` prints the summary.
"""
from __future__ import annotations

import json
import logging
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from airflow_provider_lr.engine.session.stream import StreamSettings
from airflow_provider_lr.engine.source import full_sync, trim
from tests.support.session import apply
from tests.support.soak import (
    CLIENT,
    SINKS,
    SOURCE,
    Writer,
    compare,
    drain,
    expire_leases,
    kill,
    prepare_sites,
    replay_sink,
    source_counters,
    spawn_runner,
)

# leases that run out fast after a kill; small batches (more boundaries); a short data timeout
SETTINGS = {"lease_seconds": 1.5, "max_entries": 500, "data_timeout": 10.0, "barrier_timeout": 2.0}
CHAOS_SECONDS = float(os.environ.get("LR_STREAM_SOAK_SECONDS", "20"))
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


class StreamChaos:
    def __init__(self, rng: random.Random, sites, site_manager, topo, tmp_path: Path) -> None:
        self.rng, self.sites, self.site_manager, self.topo = rng, sites, site_manager, topo
        self.source = sites[0]
        self.log = tmp_path / "streamers.log"
        self.faults: Counter[str] = Counter()
        self.serial = 0
        self.streamers: list = []

    def spawn(self) -> None:
        self.serial += 1
        self.streamers.append(spawn_runner(self.topo, self.sites, f"stream-soak-{self.serial}", SETTINGS, cycles=0,
                                           log_path=self.log, stream=STREAM_FOR,
                                           check_interval=StreamSettings().check_interval))

    def _request(self, sink: str) -> None:
        conn = self.source.connect()
        try:
            full_sync.request_full_sync(conn, sink, CLIENT, "stream soak", forced=True)
        finally:
            conn.close()

    # --- actions ---------------------------------------------------------------------------
    def full_sync(self) -> None:
        self._request(self.rng.choice(SINKS))
        self.faults["full_sync"] += 1

    def back_to_back(self) -> None:
        """Two or three requests within ~50 ms: for one sink (the newer cancels the older), or both."""
        sinks = [self.rng.choice(SINKS)] * 2 if self.rng.random() < 0.5 else list(SINKS)
        if self.rng.random() < 0.3:
            sinks.append(self.rng.choice(SINKS))
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
        site_id = self.rng.choice(SINKS)
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

    def stop(self) -> None:
        for proc in self.streamers:
            kill(proc)
        self.streamers.clear()
        down = [s.site_id for s in self.sites if not self.site_manager.is_running(s.server)]
        if down:
            self.site_manager.up(site_ids=down)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(max(600, int(CHAOS_SECONDS * 2) + 300))
def test_streaming_soak_delivers_every_message_once_through_full_syncs_kills_and_races(
        lr_sites, site_manager, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="airflow_provider_lr")
    seed = _seed()
    rate = float(os.environ.get("LR_SOAK_RATE", "150"))
    print(f"\nstreaming soak: seed {seed}, {CHAOS_SECONDS:.0f}s of chaos, {rate:.0f} tx/s", flush=True)
    rng = random.Random(seed)
    source = lr_sites[0]
    prepare_sites(lr_sites)
    topo = apply(lr_sites, [{"source": SOURCE, "sinks": list(SINKS), "clients": [CLIENT]}],
                 providers={CLIENT: LARGE_PROVIDER}, settings={"lease_seconds": SETTINGS["lease_seconds"]})
    chaos = StreamChaos(rng, lr_sites, site_manager, topo, tmp_path)
    writer = Writer(source, seed=rng.randrange(2**31), rate=rate, tag="w").start()
    steps: list[str] = []
    started = time.monotonic()
    try:
        chaos.spawn()
        end = time.monotonic() + CHAOS_SECONDS
        while time.monotonic() < end:
            steps.append(chaos.step())
    finally:
        writer.stop()
        chaos.stop()
    expire_leases(source)
    drained, reports, rounds = drain(topo, lr_sites, SETTINGS, timeout=120)

    failures: list[str] = []
    if not drained:
        failures.append("sessions never settled: " + "; ".join(
            f"{r.session} state={r.state} remaining={r.remaining} error={r.error!r}" for r in reports))
    per_sink, lost, duplicated, twice = {}, 0, 0, 0
    sinks = {s.site_id: s for s in lr_sites[1:]}
    for sink_id in SINKS:
        truth = source_counters(source, sink_id)
        seen = replay_sink(sinks[sink_id])
        sink_lost, sink_dup, diffs = compare(truth, seen.state)
        lost, duplicated, twice = lost + sink_lost, duplicated + sink_dup, twice + len(seen.twice)
        per_sink[sink_id] = {"log_entries": seen.log_entries, "full_syncs": seen.full_syncs, "lost": sink_lost,
                             "duplicated": sink_dup, "log_entries_twice": len(seen.twice)}
        if diffs:
            failures.append(f"{sink_id}: replay != source: lost {sink_lost}, duplicated {sink_dup}: "
                            f"{dict(list(diffs.items())[:5])}")
        if seen.twice:
            failures.append(f"{sink_id}: {len(seen.twice)} messages reached the queue twice as log entries, "
                            f"e.g. {seen.twice[:3]}")
    open_requests = source.query("SELECT sink_site_id, status, note FROM lr.full_sync_requests "
                                 "WHERE status IN ('pending', 'supplied')")
    if open_requests:
        failures.append(f"full-sync requests left open: {open_requests}")
    summary = {"seed": seed, "chaos_seconds": CHAOS_SECONDS, "wall_seconds": round(time.monotonic() - started, 1),
               "transactions": writer.stats.committed, "messages": writer.stats.messages,
               "steps": len(steps), "faults": dict(sorted(chaos.faults.items())), "lost": lost,
               "duplicated": duplicated, "log_entries_twice": twice, "per_sink": per_sink, "drain_rounds": rounds,
               "writer_errors": writer.errors[:5], "failures": failures}
    print(f"streaming soak: seed={seed} seconds={CHAOS_SECONDS:.0f} transactions={writer.stats.committed} "
          f"faults={summary['faults']} lost={lost} duplicated={duplicated} twice={twice}"
          + (f" FAILED: {len(failures)}" if failures else " ok"), flush=True)
    if os.environ.get("LR_SOAK_REPORT"):
        Path(os.environ["LR_SOAK_REPORT"]).write_text(json.dumps(summary, indent=2, default=str))
    assert not failures, f"streaming soak seed {seed}:\n" + "\n".join(failures) + f"\n{json.dumps(summary, default=str)}"
