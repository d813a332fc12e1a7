"""Fan-out benchmark (docs/spark.md): lr beside its anchors, same workload, same servers, one run.

Today it measures the anchors from ``fanout_anchors`` (physical binary COPY, a naive Python
replicator, native logical replication initial sync and streaming). lr's own measurements plug in
through ``MEASUREMENTS``: decorate a function ``(BenchEnv, Workload) -> Measurement`` with
``@register("lr_catchup")`` (or add it to the dict) and it runs after the anchors of each variant,
and its deliveries/s is printed with its ratio to every anchor of that variant.

Servers: 4 embedded PostgreSQL 18 servers (source + 3 sinks) in a temp home, PostgreSQL's default
durability unless ``--fast`` (fsync, synchronous_commit and full_page_writes off).

Run: .venv/bin/python bench/fanout_bench.py [--entries 1000000] [--variants all,subset]
     [--only physical_copy,native_initial] [--writers 4] [--batch 1000] [--fast] [--keep]
Writes bench/results/fanout_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout_anchors import (  # noqa: E402
    ANCHORS,
    BACKLOG_TABLE,
    BenchEnv,
    Measurement,
    Workload,
    execute,
    prepare_source,
    settle,
    start_env,
    stop_env,
)

Measure = Callable[[BenchEnv, Workload], Measurement]

# Everything that runs per variant, in order: the anchors first, then whatever lr registers.
MEASUREMENTS: dict[str, Measure] = dict(ANCHORS)


def register(name: str) -> Callable[[Measure], Measure]:
    """Add a measurement (lr's catch-up, lr's streaming, …) to the run, after the anchors.

    It gets the running ``BenchEnv`` (source and sink DSNs) and the ``Workload``; the backlog
    table ``fanout_entries`` is filled on the source; lr sets up its own schema and data.
    """

    def add(fn: Measure) -> Measure:
        MEASUREMENTS[name] = fn
        return fn

    return add


# --- lr measurements ---------------------------------------------------------------------------
# Hook: define lr's runs here with @register("lr_catchup") / @register("lr_streaming"), or keep them
# in bench/fanout_lr.py as a dict and merge it here: `MEASUREMENTS.update(fanout_lr.MEASUREMENTS)`
# (that module must not import this script: run as __main__, it would be a second copy).
import fanout_lr  # noqa: E402

MEASUREMENTS.update(fanout_lr.MEASUREMENTS)


def print_table(results: list[Measurement]) -> None:
    """Deliveries/s of each, the CPU it spent by role (source server, the 3 sinks' servers, the
    client side: this process and its children) in core-µs per delivery, and lr's ratios."""
    print(
        f"\n{'measurement':<22} {'variant':<7} {'entries':>10} {'deliveries':>11} {'seconds':>8} {'deliveries/s':>13}"
        f" {'core-µs/delivery: source + sinks + client':>42}"
    )
    for m in results:
        cpu = m.details.get("cpu_s") or {}
        per = {role: s / m.deliveries * 1e6 for role, s in cpu.items()} if m.deliveries else {}
        split = " + ".join(f"{per[r]:.2f}" for r in ("source", "sinks", "client") if r in per)
        total = f"{sum(per.values()):.2f} = {split}" if per else ""
        print(
            f"{m.name:<22} {m.variant:<7} {m.entries:>10,} {m.deliveries:>11,} {m.seconds:>8.2f} {m.per_second:>13,.0f}"
            f" {total:>42}"
        )
    others = [m for m in results if m.name not in ANCHORS]
    for m in others:
        anchors = [a for a in results if a.name in ANCHORS and a.variant == m.variant]
        ratios = ", ".join(f"{m.per_second / a.per_second:.2f}× {a.name}" for a in anchors)
        print(f"  {m.name} ({m.variant}): {ratios}")


def server_info(env: BenchEnv) -> dict[str, str]:
    keys = ("server_version", "fsync", "synchronous_commit", "full_page_writes", "shared_buffers", "max_wal_size")
    rows = execute(env.source_dsn, f"SELECT name, setting FROM pg_settings WHERE name IN {keys!r}")
    return dict(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--variants", default="all,subset", help="comma list of: all, subset")
    parser.add_argument("--only", default="", help="comma list of measurement names (default: all registered)")
    parser.add_argument("--writers", type=int, default=4, help="concurrent writers of the streaming runs")
    parser.add_argument("--batch", type=int, default=1000, help="rows per writer transaction / replicator batch")
    parser.add_argument("--fast", action="store_true", help="fsync, synchronous_commit, full_page_writes off")
    parser.add_argument("--keep", action="store_true", help="leave the servers' data directory in place")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "fanout_bench.json")
    args = parser.parse_args(argv)

    variants = [v for v in args.variants.split(",") if v]
    chosen = [n for n in args.only.split(",") if n] or list(MEASUREMENTS)
    unknown = sorted(set(variants) - {"all", "subset"}) + sorted(set(chosen) - set(MEASUREMENTS))
    if unknown:
        parser.error(f"unknown variant or measurement: {', '.join(unknown)} (measurements: {', '.join(MEASUREMENTS)})")

    load_before = os.getloadavg()  # the machine may be shared: record how busy it was
    home = Path(tempfile.mkdtemp(prefix="lr-fanout-bench-"))
    print(f"starting 4 PostgreSQL servers under {home} ({'fast' if args.fast else 'default durability'})", flush=True)
    env = start_env(home, fast=args.fast)
    results: list[Measurement] = []
    try:
        info = server_info(env)
        for variant in variants:
            workload = Workload(args.entries, variant, writers=args.writers, batch=args.batch)
            t0 = time.perf_counter()
            owed = prepare_source(env, workload)
            print(
                f"[{variant}] source filled: {args.entries:,} entries, sinks owed {owed} "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
            for name in chosen:
                waited = settle(env)
                print(f"[{variant}] {name} (settled {waited:.1f} s) …", end=" ", flush=True)
                m = MEASUREMENTS[name](env, workload)
                results.append(m)
                print(
                    f"{m.deliveries:,} deliveries in {m.seconds:.2f} s = {m.per_second:,.0f}/s {m.details or ''}",
                    flush=True,
                )
            execute(env.source_dsn, f"DROP TABLE IF EXISTS {BACKLOG_TABLE}")
    finally:
        stop_env(env, remove=not args.keep)
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)

    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "entries": args.entries,
                "variants": variants,
                "fast": args.fast,
                "writers": args.writers,
                "batch": args.batch,
                "machine": {
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(),
                },
                "server": info,
                "measurements": [m.as_dict() for m in results],
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
