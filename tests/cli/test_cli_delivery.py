"""`lr status` shows delivery (issue 15): readiness against the first guarded position, counted
live, and each source's durable position, counting only the sinks each entry named."""

from __future__ import annotations

import json

import yaml

from airflow_provider_lr import cli
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.source import delivery
from airflow_provider_lr.engine.store import topology
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.cli.test_cli_sync import topology_file
from tests.support.session import App, replicator


def _site_a(path: str, capsys) -> dict:
    capsys.readouterr()
    cli.main(["status", "--topology", path, "--json"])
    return json.loads(capsys.readouterr().out)["sites"]["site-a"]


def _session(report: dict, sink: str) -> dict:
    return next(s for s in report["sessions"] if s["role"] == "source" and s["sink_site_id"] == sink)


def _sync(path: str) -> None:
    assert cli.main(["sync", "--topology", path, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0


def test_status_shows_readiness_before_a_guard_and_the_durable_position(lr_sites, tmp_path, monkeypatch, capsys):
    path = topology_file(tmp_path, lr_sites, monkeypatch)
    doc = yaml.safe_load(open(path))
    doc["durability"] = {"min_regions_for_durability": 2}
    open(path, "w").write(yaml.safe_dump(doc))
    assert cli.main(["topology", "apply", "--topology", path]) == 0
    app = App(lr_sites[0])
    app.put("first", 1, ["site-b", "site-c"])
    _sync(path)
    only_b = delivery.resolve(app.conn, app.put("b", 2, ["site-b"]))
    only_c = delivery.resolve(app.conn, app.put("c", 3, ["site-c"]))
    repl = replicator(topology.load(path), lr_sites, sessions=[SessionKey("site-a", "site-c", "policy")])
    run_until_idle(repl)  # only site-c: its acknowledged position passes only_b, which it never got
    repl.close()
    report = _site_a(path, capsys)
    durable = report["durable"]
    assert durable["min_regions"] == 2 and durable["rule"] == "stored in >= 2 regions"
    assert durable["position"] == only_b - 1  # site-c's acknowledgement does not count for only_b
    assert _session(report, "site-b")["readiness"] == "catching up (1 to send)"
    assert _session(report, "site-c")["readiness"] == "ready"

    guard = delivery.add_guard(app.conn, "policy", only_c + 1, ["site-b"], 60)  # a producer waits past both
    app.put("d", 4, ["site-b"])
    b = _session(_site_a(path, capsys), "site-b")
    assert b["first_guarded"] == only_c + 1
    assert b["readiness"] == f"catching up (1 before guard {only_c + 1})"
    cli.main(["status", "--topology", path])
    text = capsys.readouterr().out
    assert "durable up to position" in text and "(every entry stored in >= 2 regions)" in text
    _sync(path)
    report = _site_a(path, capsys)
    assert _session(report, "site-b")["readiness"] == "ready"
    assert report["durable"]["position"] == report["durable"]["last_position"]
    delivery.remove_guard(app.conn, guard)
    app.close()
