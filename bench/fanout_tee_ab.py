"""The in-process tee of two source trees, interleaved on one backlog (docs/spark.md, "Where the
tee's time goes"): on a shared machine only variants run side by side compare.

The backlog (``fanout_lr.LrSites.fill_backlog``: N entries × 256 B to the 3 sinks) is written
once; each round copies the 4 lr databases (``CREATE DATABASE … TEMPLATE … STRATEGY FILE_COPY``)
for each tree and runs ``fanout.run_fanout`` in a child process with that tree first on its
``PYTHONPATH``, timing the run and the CPU of the child (the tee's Python, its sender threads
included), of the source server and of the sink servers (``fanout_anchors.server_cpu_s``).

Run: .venv/bin/python bench/fanout_tee_ab.py --entries 500000 --variant all --rounds 3 OLD_TREE NEW_TREE
(a tree is a directory holding ``airflow_provider_lr``: e.g. ``git archive <commit>`` unpacked).
Writes bench/results/fanout_tee_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fanout_lr  # noqa: E402
from fanout_anchors import Workload, execute, prepare_source, server_cpu_s, settle, start_env, stop_env  # noqa: E402

CHILD = """
import json, resource, sys
from airflow_provider_lr.engine.bulk import fanout
from airflow_provider_lr.engine.store import topology
driver = fanout.FanoutDriver(topology.from_document(json.load(open(sys.argv[1]))), sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF)
try:
    result = fanout.run_fanout(driver, fanout.local_map)
finally:
    driver.close()
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
print(json.dumps({"ok": result.ok, "deliveries": sum(result.deliveries.values()), "seconds": result.seconds,
                  "cpu_s": round(cpu, 2), "errors": result.errors}))
"""


def run_tree(sites: fanout_lr.LrSites, tree: str, tag: str) -> dict:
    """The tee of ``tree`` on fresh copies of the filled lr databases."""
    for dsn, db in zip(sites.admin, sites.dbnames):
        execute(dsn, f"CREATE DATABASE {db}_{tag} TEMPLATE {db} STRATEGY FILE_COPY")
    conns = {
        site: {**conn, "schema": f"{conn['schema']}_{tag}"}
        for site, conn in json.loads(sites.connections.read_text()).items()
    }
    connections = sites.dir / f"connections_{tag}.json"
    connections.write_text(json.dumps(conns))
    connections.chmod(0o600)
    try:
        env = dict(os.environ, PYTHONPATH=tree, LR_CONNECTIONS_FILE=str(connections))
        args = [sys.executable, "-c", CHILD, str(sites.topology_file), fanout_lr.SOURCE_ID]
        servers = [server_cpu_s(sites.admin[0]), sum(server_cpu_s(dsn) for dsn in sites.admin[1:])]
        # run from the tree: ``python -c`` puts the working directory first on the path
        out = subprocess.run(args, env=env, cwd=tree, capture_output=True, text=True, check=False)
        servers = [
            server_cpu_s(sites.admin[0]) - servers[0],
            sum(server_cpu_s(dsn) for dsn in sites.admin[1:]) - servers[1],
        ]
        if out.returncode:
            raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if not result["ok"]:
            raise RuntimeError(f"{tree}: {result['errors']}")
        result.update(source_cpu_s=round(servers[0], 2), sinks_cpu_s=round(servers[1], 2))
        return result
    finally:
        for dsn, db in zip(sites.admin, sites.dbnames):
            execute(dsn, f"DROP DATABASE IF EXISTS {db}_{tag} WITH (FORCE)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--entries", type=int, default=500_000)
    parser.add_argument("--variant", default="all", choices=("all", "subset"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "fanout_tee_ab.json")
    args = parser.parse_args(argv)

    home = Path(tempfile.mkdtemp(prefix="lr-tee-ab-"))
    env = start_env(home)
    runs = []
    try:
        workload = Workload(args.entries, args.variant)
        prepare_source(env, workload)
        sites = fanout_lr.LrSites(env, "lr_ab")
        sites.fill_backlog(env, workload)
        for round_ in range(args.rounds):
            for index, tree in enumerate(args.trees):
                settle(env)
                result = run_tree(sites, tree, f"r{round_}t{index}")
                per_s = result["deliveries"] / result["seconds"]["total"]
                result.update(tree=tree, round=round_, deliveries_per_s=round(per_s), load=os.getloadavg()[0])
                runs.append(result)
                print(
                    f"round {round_} {tree}: {per_s:,.0f} deliveries/s in {result['seconds']['total']:.2f} s, "
                    f"CPU s: tee {result['cpu_s']:.2f}, source {result['source_cpu_s']:.2f}, "
                    f"sinks {result['sinks_cpu_s']:.2f}; load {result['load']:.1f}",
                    flush=True,
                )
    finally:
        stop_env(env)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"entries": args.entries, "variant": args.variant, "runs": runs}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
