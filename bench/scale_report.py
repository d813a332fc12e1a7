"""The scale bench's figures as a markdown table, and the issue's aims checked against them
(``scale_bench.py`` writes the JSON; ``python bench/scale_report.py FILE.json`` prints this again)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

LR_COST = ("lr_sync", "lr_backends", "subscribers", "subscriber_backends")  # billed to lr
NATIVE_COST = ("walsenders", "apply_workers")  # billed to native
SOURCE = "src"


def cpu_per_10k(run: dict[str, Any], roles: tuple[str, ...]) -> float | None:
    usage = run.get("details", {}).get("usage")
    if not usage or not run.get("delivered"):
        return None
    return sum(usage["cpu_s"].get(r, 0.0) for r in roles) / run["delivered"] * 10_000


def lr_connections(run: dict[str, Any]) -> dict[str, int]:
    """``lr sync``'s connections: on the source, the most on one sink, at once over every site; and
    the sink applications' at once over every sink."""
    details = run.get("details", {})
    usage, sites = details.get("usage", {}), details.get("sites_by_database", {})
    held = usage.get("connections", {}).get("lr_backends", {})
    on_source = sum(n for db, n in held.items() if sites.get(db) == SOURCE)
    on_sinks = [n for db, n in held.items() if sites.get(db) not in (None, SOURCE)]
    return {
        "source": on_source,
        "sink_max": max(on_sinks, default=0),
        "total": usage.get("connections_total", {}).get("lr_backends", 0),
        "steady": usage.get("connections_end", {}).get("lr_backends", 0),  # once the cycles' connections rested
        "applications": usage.get("connections_total", {}).get("subscriber_backends", 0),
        "sites": len(sites),
    }


def native_connections(run: dict[str, Any]) -> dict[str, int]:
    usage = run.get("details", {}).get("usage", {})
    applies = usage.get("connections", {}).get("apply_workers", {})
    return {
        "walsenders": usage.get("connections_total", {}).get("walsenders", 0),
        "apply_max": max(applies.values(), default=0),
    }


def _ms(lag: dict[str, Any]) -> str:
    p50, p99 = lag.get("p50"), lag.get("p99")
    return "–" if p50 is None else f"{p50:,.1f} / {p99:,.1f}"


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def rows(doc: dict[str, Any]) -> list[str]:
    out = [
        "| sinks × clients | sessions | writers/s | lr p50 / p99 ms | lr lost / dup | lr CPU s / 10k "
        "| lr conns source / sink / all, at the end (apps) | lr threads / RSS MB | native p50 / p99 ms | native lost / dup "
        "| native CPU s / 10k | native walsenders / apply per sink |",
        "|---|---:|---:|---|---|---:|---|---|---|---|---:|---|",
    ]
    for row in doc["configurations"]:
        lr, nat = row.get("lr"), doc.get("native", {}).get(str(row["sinks"]))
        cells = [row["layout"], str(row["sessions"])]
        if lr:
            conns, usage = lr_connections(lr), lr["details"].get("usage", {})
            cells += [
                f"{lr['achieved_per_s']:,.0f}",
                _ms(lr["lag_ms"]),
                f"{lr['lost']} / {lr['duplicated']}" + ("" if lr["drained"] else " (not drained)"),
                _num(cpu_per_10k(lr, LR_COST)),
                f"{conns['source']} / {conns['sink_max']} / {conns['total']}, {conns['steady']} "
                f"({conns['applications']})",
                f"{usage.get('threads', 0)} / {usage.get('rss_mb', 0):,.0f}",
            ]
        else:
            cells += ["–"] * 6
        if nat:
            conns = native_connections(nat)
            cells += [
                _ms(nat["lag_ms"]),
                f"{nat['lost']} / {nat['duplicated']}" + ("" if nat["drained"] else " (not drained)"),
                _num(cpu_per_10k(nat, NATIVE_COST)),
                f"{conns['walsenders']} / {conns['apply_max']}",
            ]
            if not lr:
                cells[2] = f"{nat['achieved_per_s']:,.0f}"
        else:
            cells += ["–"] * 4
        out.append("| " + " | ".join(cells) + " |")
    return out


def takeover_lines(doc: dict[str, Any]) -> list[str]:
    out = []
    for t in doc.get("takeover", []):
        taken = (
            f"{t['takeover_s']:.1f} s"
            if t["takeover_s"] is not None
            else f"not within {t['wait_bound_s']:g} s ({t['sessions_resumed']}/{t['sessions']} sessions resumed)"
        )
        cpu = ", ".join(f"#{k} {v:.2f} s" for k, v in t["cpu_s_before_kill"].items())
        out.append(
            f"Takeover ({t['layout']}, {t['rate']}/s, two `lr sync`, SIGKILL of replicator {t['victim']} after "
            f"{t['kill_after_s']:g} s; CPU in the 2 s before: {cpu}): every session delivering "
            f"entries written after the kill again after **{taken}**; {t['sessions_stalled_over_1s']} sessions "
            f"stalled over 1 s; lost {t['lost']}, duplicated {t['duplicated']}"
            + ("" if t["drained"] else " (not drained)")
            + "."
        )
    return out


def aims(doc: dict[str, Any]) -> list[str]:
    """The issue's aims, where this run has the configurations they compare."""
    by_sessions = {row["sessions"]: row for row in doc["configurations"] if row.get("lr")}
    out = []
    one, many = by_sessions.get(1), by_sessions.get(32)
    if one and many and one["lr"]["lag_ms"]["p50"] and many["lr"]["lag_ms"]["p50"] is not None:
        ratio = many["lr"]["lag_ms"]["p50"] / one["lr"]["lag_ms"]["p50"]
        out.append(f"* p50 lag at 32 sessions / at 1: {ratio:.1f}× (aim ≤ 2×)")
        rate = many["lr"]["achieved_per_s"] / one["lr"]["achieved_per_s"]
        out.append(f"* writers at 32 sessions / at 1: {rate:.2f}× (aim ≥ 0.9×)")
    eight = next((r for r in doc["configurations"] if r["sinks"] == 8 and r["clients"] == 1 and r.get("lr")), None)
    nat = doc.get("native", {}).get("8")
    if eight and nat:
        lr_cpu, nat_cpu = cpu_per_10k(eight["lr"], LR_COST), cpu_per_10k(nat, NATIVE_COST)
        if lr_cpu and nat_cpu:
            out.append(f"* CPU per delivery at 8 sinks, lr / native: {lr_cpu / nat_cpu:.1f}× (aim ≤ 2×)")
    worst = max(
        (lr_connections(r["lr"]) for r in doc["configurations"] if r.get("lr")),
        key=lambda c: c["steady"] - c["sites"],
        default=None,
    )
    if worst:
        out.append(
            f"* connections of the replicator, worst configuration: {worst['steady']} for {worst['sites']} sites "
            f"once streaming ({worst['total']} at most, while the cycles' connections had not rested) "
            f"(aim ≤ sites + 4 = {worst['sites'] + 4})"
        )
    for t in doc.get("takeover", []):
        out.append(
            f"* takeover after SIGKILL: {_num(t['takeover_s'], '{:.1f} s')}, lost {t['lost']}, duplicated "
            f"{t['duplicated']} (aim ≤ 5 s, 0, 0)"
        )
    return out


def markdown(doc: dict[str, Any]) -> str:
    args = doc.get("args", {})
    head = (
        f"{args.get('rate')} tx/s from {args.get('writers')} writers, {args.get('seconds')} s per configuration "
        f"after {args.get('warmup')} s of warm-up; `{doc.get('versions', {}).get('lr_cmd')}` at "
        f"{doc.get('versions', {}).get('git')}; load {doc.get('machine', {}).get('loadavg_before', ['?'])[0]:.2f} before"
    )
    lines = [head, "", *rows(doc)] if doc["configurations"] else [head]
    tail = takeover_lines(doc)
    if tail:
        lines += ["", *tail]
    checked = aims(doc)
    if checked:
        lines += ["", "Against the aims:", *checked]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(json.loads(Path(sys.argv[1]).read_text())), end="")
