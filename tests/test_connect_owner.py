"""Every connection lr opens is bounded (keepalives, timeouts, a call deadline: engine/db/timeouts.py)
because one module opens them all: ``engine/db/conninfo.py``. A ``psycopg2.connect`` (or
``psycopg.connect``) anywhere else in the package or the Spark jobs would open one without its
bounds, and a hung call there would stall its process for good; this source scan refuses it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = [REPO / "airflow_provider_lr", REPO / "spark_jobs", REPO / "dags"]
OWNER = REPO / "airflow_provider_lr" / "engine" / "db" / "conninfo.py"
DRIVERS = {"psycopg2", "psycopg"}


def direct_connects(path: Path) -> list[str]:
    """``file:line`` of each call of a driver's ``connect`` in ``path``: ``psycopg2.connect(...)``,
    ``psycopg2.extensions.connection(...)``, or a ``connect`` imported from a driver."""
    tree = ast.parse(path.read_text(), str(path))
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in DRIVERS
        for alias in node.names
        if alias.name == "connect"
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        dotted = []
        while isinstance(func, ast.Attribute):
            dotted.append(func.attr)
            func = func.value
        if isinstance(func, ast.Name):
            dotted.append(func.id)
        dotted.reverse()
        by_driver = dotted[:1] and dotted[0] in DRIVERS and dotted[-1] in ("connect", "connection")
        if by_driver or (len(dotted) == 1 and dotted[0] in imported):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {'.'.join(dotted)}(...)")
    return found


def test_only_conninfo_connects():
    offenders = [
        hit for root in SCANNED for path in sorted(root.rglob("*.py")) if path != OWNER for hit in direct_connects(path)
    ]
    assert not offenders, (
        "connect through engine/db/conninfo.py (ConnInfo.connect, connect_dsn) so the "
        "connection gets lr's keepalives and timeouts:\n" + "\n".join(offenders)
    )


def test_the_scan_sees_a_direct_connect(tmp_path):
    """The scan itself can fail: each spelling of a direct connect is found."""
    module = tmp_path / "m.py"
    module.write_text(
        "import psycopg2\nfrom psycopg import connect as c\n"
        "a = psycopg2.connect('')\nb = c('')\nd = psycopg2.extensions.connection('')\n"
    )
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        assert [hit.split(":")[1] for hit in direct_connects(module)] == ["3", "4", "5"]
    finally:
        REPO = saved
    assert direct_connects(OWNER), "the owner's own connect is found (so the scan reads real code)"
