"""`lr failover` stopped part-way by a site whose connection is lost (its server stopped, its
backend ended) says which site and what to do, and doing it (the same command again) finishes the
failover."""

from __future__ import annotations

from airflow_provider_lr import cli
from tests.cli.test_cli_sync import topology_file
from tests.support.session import App

# site-c's backend ends itself when the failover fences its session from site-a: its connection is
# lost mid-step, as when its server stops then
DIE_AT_FENCE = """
CREATE FUNCTION public.die_at_fence() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NEW; END $$;
CREATE TRIGGER die_at_fence BEFORE UPDATE ON lr.sink_sessions FOR EACH ROW
    WHEN (NEW.failed_over_to IS NOT NULL AND OLD.failed_over_to IS NULL) EXECUTE FUNCTION public.die_at_fence();
"""


def test_a_failover_whose_sink_connection_is_lost_part_way_names_it_and_a_rerun_finishes_it(
    lr_sites, tmp_path, monkeypatch, capsys
):
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    App(source).put("k1", 1, ["site-b", "site-c"])
    assert cli.main(["sync", "--topology", topo, "--until-idle"]) == 0
    sink_c.query(DIE_AT_FENCE)
    new = str(tmp_path / "new.yaml")
    capsys.readouterr()
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--no-planned", "--out", new]) == 1
    said = capsys.readouterr().err
    assert "site-c" in said and "run the same command again" in said, said
    sink_c.query("DROP TRIGGER die_at_fence ON lr.sink_sessions")
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--no-planned", "--out", new]) == 0
    assert sink_c.query("SELECT failed_over_to FROM lr.sink_sessions WHERE source_site_id = 'site-a'") == [("site-b",)]
