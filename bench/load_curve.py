"""Streaming lag against the machine's load: is the service path, or the CPU left, what sets p50?

Runs ``streaming_bench.py`` (its defaults: 3 embedded servers, 2 sinks, 4 paced writer threads,
``lr sync`` and one subscriber process per sink, or native logical replication) once per rate and
system, on fresh databases each, and samples the CPU every process on the machine used over the
measured window. Per run: CPU in cores, the machine's utilisation
ρ = cores busy ÷ cores, CPU per transaction, and lag p50 / p99 from the bench.

Why: lr's p50 at 1,000/s is twice the 1.5 ms its path takes with nothing queued
(``bench/stream_components.py``); this shows how much of the machine each system's transactions
take at each rate, and how the lag follows.

``--hog`` adds load that is neither system's: processes that keep the given share of cores busy
(a duty cycle of 10 ms) through each run, so that a system's lag can be read at a utilisation its
own rate does not reach here (is the lag set by the machine's load, whoever makes it?).

Run: .venv/bin/python bench/load_curve.py [--rates 250,500,750,1000] [--systems lr,native]
     [--seconds 15] [--lr-cmd "lr sync"] [--hog 0,0.5,1.0]
Writes bench/results/load_curve.json and prints a markdown table. Needs a quiet machine: anything
else running counts as load.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
CORES = os.cpu_count() or 1


TICK = os.sysconf("SC_CLK_TCK")


def process_ticks() -> dict[int, int]:
    """CPU ticks (user + system) each live process has used: every process on the machine."""
    ticks = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    return ticks


def _spin(duty: float, stop: Any) -> None:
    """Keep a core ``duty`` busy: spin ``duty`` × 10 ms, sleep the rest, until ``stop``."""
    period = 0.01
    while not stop.is_set():
        end = time.perf_counter() + duty * period
        while time.perf_counter() < end:
            pass
        time.sleep(period * (1 - duty))


class Hog:
    """Processes that keep ``cores`` (a share of the machine's) busy while it is open."""

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.stop = mp.get_context("spawn").Event()
        count = math.ceil(cores)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_spin, args=(cores / count, self.stop), daemon=True) for _ in range(count)]

    def __enter__(self) -> Hog:
        for proc in self.procs:
            proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for proc in self.procs:
            proc.join(5)

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self.procs if p.pid is not None}


class WindowProbe:
    """The machine's busy share over the bench's measured window, found from its output: the window
    starts ``warmup`` seconds after the "writing" line and lasts ``seconds``."""

    def __init__(self, warmup: float, seconds: float, hog: set[int] | None = None) -> None:
        self.warmup, self.seconds, self.hog = warmup, seconds, hog or set()
        self.share: float | None = None
        self.hog_share = 0.0  # of that, the hog's

    def watch(self, proc: subprocess.Popen, log: list[str]) -> None:
        """Read the bench's output as it comes (its "writing" line ends only when the run does)."""
        assert proc.stdout is not None
        sampler: threading.Thread | None = None
        while chunk := os.read(proc.stdout.fileno(), 4096):
            log.append(chunk.decode(errors="replace"))
            if sampler is None and "writing" in "".join(log[-2:]):
                sampler = threading.Thread(target=self._sample, daemon=True)
                sampler.start()
        if sampler is not None:  # the output ended: so did the run, and its window long before
            sampler.join()

    def _sample(self) -> None:
        """The processes' CPU over the window (``/proc/<pid>/stat``; the machine-wide ``/proc/stat``
        counts ticks too coarsely on this kind of VM); a process that ends inside it is left out."""
        time.sleep(self.warmup + 0.5)
        before, started = process_ticks(), time.monotonic()
        time.sleep(max(1.0, self.seconds - 1.0))
        after, wall = process_ticks(), time.monotonic() - started
        used = {pid: (t - before.get(pid, 0)) / TICK for pid, t in after.items()}
        self.share = sum(used.values()) / wall / CORES
        self.hog_share = sum(v for pid, v in used.items() if pid in self.hog) / wall / CORES


def run(system: str, rate: int, args: argparse.Namespace, hog: float = 0.0) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="load-curve-")) / "run.json"
    cmd = [
        sys.executable,
        str(BENCH / "streaming_bench.py"),
        "--rates",
        str(rate),
        "--systems",
        system,
        "--seconds",
        str(args.seconds),
        "--warmup",
        str(args.warmup),
        "--lr-cmd",
        args.lr_cmd,
        "--out",
        str(out),
    ]
    log: list[str] = []
    with Hog(hog) as hogs:
        probe = WindowProbe(args.warmup, args.seconds, hogs.pids)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        probe.watch(proc, log)
    if proc.wait() != 0 or probe.share is None:
        raise RuntimeError(f"{system} at {rate}/s failed:\n{''.join(log[-20:])}")
    (result,) = json.loads(out.read_text())["results"]
    cores, hog_cores = probe.share * CORES, probe.hog_share * CORES
    return {
        "system": system,
        "rate": rate,
        "hog_cores": round(hog_cores, 3),
        "achieved_per_s": result["achieved_per_s"],
        "cores_busy": round(cores, 3),
        "utilisation": round(probe.share, 3),
        "cpu_ms_per_tx": round((cores - hog_cores) / result["achieved_per_s"] * 1000, 3),
        "p50_ms": result["lag_ms"]["p50"],
        "p99_ms": result["lag_ms"]["p99"],
        "lost": result["lost"],
        "duplicated": result["duplicated"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="250,500,750,1000")
    parser.add_argument("--systems", default="lr,native")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--lr-cmd", default="lr sync")
    parser.add_argument("--hog", default="0", help="comma list of cores kept busy by other processes, per run")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "load_curve.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs = []
    for rate in [int(r) for r in args.rates.split(",")]:
        for hog in [float(h) for h in args.hog.split(",")]:
            for system in args.systems.split(","):
                runs.append(run(system, rate, args, hog))
                r = runs[-1]
                print(
                    f"{system:6s} {rate:5d}/s  hog {r['hog_cores']:.2f}, machine {r['cores_busy']:.2f} cores "
                    f"(ρ {r['utilisation']:.2f}), "
                    f"{r['cpu_ms_per_tx']:.2f} ms CPU/tx, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
                    f"lost {r['lost']}, dup {r['duplicated']}",
                    flush=True,
                )
    print("\n| system | rate | hog (cores) | machine busy (cores) | ρ | CPU per tx | p50 | p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(
            f"| {r['system']} | {r['rate']:,}/s | {r['hog_cores']:.2f} | {r['cores_busy']:.2f} | {r['utilisation']:.2f} | "
            f"{r['cpu_ms_per_tx']:.2f} ms | {r['p50_ms']} ms | {r['p99_ms']} ms |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "cores": CORES,
                "loadavg_before": load_before,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
