"""Streaming lag against the machine's load: is the service path, or the CPU left, what sets p50?

Runs ``streaming_bench.py`` (its defaults: 3 embedded servers, 2 sinks, 4 paced writer threads,
``lr sync`` and one subscriber process per sink, or native logical replication) once per rate and
system, on fresh databases each, and samples the whole machine's busy CPU (``/proc/stat``: every
core, every process) over the measured window. Per run: CPU in cores, the machine's utilisation
ρ = cores busy ÷ cores, CPU per transaction, and lag p50 / p99 from the bench.

Then fits, over lr's runs, ``p50 = L0 + k · ρ / (1 − ρ)``: a path whose own time is ``L0`` and
whose waits for a core grow as a queue's do when the machine fills (the M/M/1 shape). ``L0`` is
what the path would take on an idle machine (``bench/stream_components.py`` measures it step by
step), ``k`` how much a busy machine stretches it; the fit says at what utilisation p50 would be
2 ms, and so how much CPU per transaction lr would have to shed at a given rate to get there.

Run: .venv/bin/python bench/load_curve.py [--rates 250,500,750,1000] [--systems lr,native]
     [--seconds 15] [--lr-cmd "lr sync"]
Writes bench/results/load_curve.json and prints a markdown table. Needs a quiet machine: anything
else running counts as load.
"""

from __future__ import annotations

import argparse
import json
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
AIM_MS = 2.0


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot (``/proc/stat``'s first line)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


class WindowProbe:
    """The machine's busy share over the bench's measured window, found from its output: the window
    starts ``warmup`` seconds after the "writing" line and lasts ``seconds``."""

    def __init__(self, warmup: float, seconds: float) -> None:
        self.warmup, self.seconds = warmup, seconds
        self.share: float | None = None

    def watch(self, proc: subprocess.Popen, log: list[str]) -> None:
        """Read the bench's output as it comes (its "writing" line ends only when the run does)."""
        assert proc.stdout is not None
        started = False
        while chunk := os.read(proc.stdout.fileno(), 4096):
            log.append(chunk.decode(errors="replace"))
            if not started and "writing" in "".join(log[-2:]):
                started = True
                threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        time.sleep(self.warmup + 0.5)
        busy0, total0 = busy_jiffies()
        time.sleep(max(1.0, self.seconds - 1.0))
        busy1, total1 = busy_jiffies()
        self.share = (busy1 - busy0) / max(1, total1 - total0)


def run(system: str, rate: int, args: argparse.Namespace) -> dict[str, Any]:
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
    probe, log = WindowProbe(args.warmup, args.seconds), []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    probe.watch(proc, log)
    time.sleep(0.1)  # the sample ends with the window, before the drain and the report
    if proc.wait() != 0 or probe.share is None:
        raise RuntimeError(f"{system} at {rate}/s failed:\n{''.join(log[-20:])}")
    (result,) = json.loads(out.read_text())["results"]
    cores = probe.share * CORES
    return {
        "system": system,
        "rate": rate,
        "achieved_per_s": result["achieved_per_s"],
        "cores_busy": round(cores, 3),
        "utilisation": round(probe.share, 3),
        "cpu_ms_per_tx": round(cores / result["achieved_per_s"] * 1000, 3),
        "p50_ms": result["lag_ms"]["p50"],
        "p99_ms": result["lag_ms"]["p99"],
        "lost": result["lost"],
        "duplicated": result["duplicated"],
    }


def fit(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares of p50 = L0 + k·x, x = ρ/(1−ρ), over ``runs``."""
    xs = [r["utilisation"] / (1 - r["utilisation"]) for r in runs]
    ys = [r["p50_ms"] for r in runs]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n > 1 and sxx else 0.0
    l0 = my - k * mx
    x_aim = (AIM_MS - l0) / k if k > 0 else float("inf")
    return {"L0_ms": round(l0, 3), "k_ms": round(k, 3), "utilisation_at_aim": round(x_aim / (1 + x_aim), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="250,500,750,1000")
    parser.add_argument("--systems", default="lr,native")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--lr-cmd", default="lr sync")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "load_curve.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs = []
    for rate in [int(r) for r in args.rates.split(",")]:
        for system in args.systems.split(","):
            runs.append(run(system, rate, args))
            r = runs[-1]
            print(
                f"{system:6s} {rate:5d}/s  machine {r['cores_busy']:.2f} cores (ρ {r['utilisation']:.2f}), "
                f"{r['cpu_ms_per_tx']:.2f} ms CPU/tx, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
                f"lost {r['lost']}, dup {r['duplicated']}",
                flush=True,
            )
    lr = [r for r in runs if r["system"] == "lr"]
    model = fit(lr) if len(lr) > 1 else {}
    print("\n| system | rate | machine busy (cores) | ρ | CPU per tx | p50 | p99 | p50 fitted |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        fitted = ""
        if model and r["system"] == "lr":
            x = r["utilisation"] / (1 - r["utilisation"])
            fitted = f"{model['L0_ms'] + model['k_ms'] * x:.2f} ms"
        print(
            f"| {r['system']} | {r['rate']:,}/s | {r['cores_busy']:.2f} | {r['utilisation']:.2f} | "
            f"{r['cpu_ms_per_tx']:.2f} ms | {r['p50_ms']} ms | {r['p99_ms']} ms | {fitted} |"
        )
    if model:
        print(
            f"\nfit over lr's runs: p50 = {model['L0_ms']} ms + {model['k_ms']} ms · ρ/(1−ρ); "
            f"p50 = {AIM_MS} ms at ρ = {model['utilisation_at_aim']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "cores": CORES,
                "loadavg_before": load_before,
                "runs": runs,
                "fit_lr": model,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
