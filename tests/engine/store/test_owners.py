"""One owner per shared table: only the table's store module writes its name in SQL.

Every string constant of the package (f-string parts too, docstrings aside) is searched for the
table's qualified name; one outside the owner fails the test, named as module:line. A table with
siblings that are its owner's too lists their names in its pattern.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "airflow_provider_lr"

# table -> (its owner, relative to the package; what names it in SQL)
OWNERS: dict[str, tuple[str, re.Pattern[str]]] = {
    "receive_consumed": ("engine/store/receive_queue.py", re.compile(r"\blr\.receive_consumed\b")),
    "receive_queue": ("engine/store/receive_queue.py", re.compile(r"\blr\.receive_queue\b")),
    "replicator_members": ("engine/store/members.py", re.compile(r"\blr\.replicator_members\b")),
    "sink_sessions": ("engine/store/sink_sessions.py", re.compile(r"\blr\.sink_sessions\b")),
    "source_sessions": ("engine/store/source_sessions.py", re.compile(r"\blr\.source_sessions\b")),
    "topology": ("engine/store/topology.py", re.compile(r"\blr\.topology\b")),
}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.add(id(first.value))
    return found


def naming(source: str, pattern: re.Pattern[str]) -> list[int]:
    """Lines of ``source`` whose string constants (not docstrings; f-string parts included) match ``pattern``."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return sorted(
        {
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and pattern.search(node.value)
        }
    )


def offenders(table: str, root: Path = PACKAGE) -> list[str]:
    owner, pattern = OWNERS[table]
    return [
        f"{path.relative_to(root.parent)}:{line}"
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root).as_posix() != owner
        for line in naming(path.read_text(), pattern)
    ]


@pytest.mark.parametrize("table", sorted(OWNERS))
def test_only_the_owner_names_the_table_in_sql(table: str):
    found = offenders(table)
    assert found == [], f"lr.{table} is {OWNERS[table][0]}'s; SQL naming it elsewhere: {found}"


@pytest.mark.parametrize("table", sorted(OWNERS))
def test_the_owner_is_where_the_map_says(table: str):
    owner, pattern = OWNERS[table]
    assert naming((PACKAGE / owner).read_text(), pattern), f"{owner} does not name lr.{table}"


def test_an_offender_is_found_in_sql_but_not_in_docstrings_or_sibling_tables(tmp_path: Path):
    """The detector itself, so the tests above cannot pass for finding nothing anywhere."""
    snippet = '''"""Reads lr.source_sessions and lr.topology (a docstring: not SQL)."""
def f(cur, column):
    """Also lr.source_sessions here."""
    cur.execute(f"SELECT {column} FROM lr.source_sessions WHERE x = 1")
    cur.execute("SELECT topology_config_id FROM lr.topology")
    cur.execute("SELECT 1 FROM lr.topology_history")
'''
    (tmp_path / "airflow_provider_lr" / "engine").mkdir(parents=True)
    (tmp_path / "airflow_provider_lr" / "engine" / "mover.py").write_text(snippet)
    assert offenders("source_sessions", tmp_path / "airflow_provider_lr") == ["airflow_provider_lr/engine/mover.py:4"]
    assert offenders("topology", tmp_path / "airflow_provider_lr") == ["airflow_provider_lr/engine/mover.py:5"]
