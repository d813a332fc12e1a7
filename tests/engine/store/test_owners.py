"""One owner per shared table: only the table's store module writes SQL that names it.

Every string constant of every module under ``airflow_provider_lr/`` is read (f-string parts too;
docstrings and comments aside, they may talk about a table): one that names a table outside its
owner fails, with module:line. (A sink's receive queues are rows of the one ``lr.receive_queue``,
told apart by session: there are no per-queue tables whose names need matching.)
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "airflow_provider_lr"

OWNERS = {
    "receive_consumed": "airflow_provider_lr/engine/store/receive_queue.py",
    "receive_queue": "airflow_provider_lr/engine/store/receive_queue.py",
    "sink_sessions": "airflow_provider_lr/engine/store/sink_sessions.py",
}

# Modules another branch restructures; their statements on these tables move to the stores when the
# branches merge (this set is emptied then).
NOT_YET_CONVERTED = {"airflow_provider_lr/engine/site/status.py", "airflow_provider_lr/engine/site/topology.py"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.add(id(value))
    return found


def offenders(table: str, owner: str, root: Path = ROOT, files: list[Path] | None = None) -> list[str]:
    """``module:line`` of every string outside ``owner`` that names ``lr.<table>``."""
    pattern = re.compile(rf"\blr\.{re.escape(table)}\b")
    found = []
    for path in files if files is not None else sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name == owner:
            continue
        tree = ast.parse(path.read_text(), filename=name)
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
                    and pattern.search(node.value)):
                found.append(f"{name}:{node.lineno}")
    return sorted(set(found))


@pytest.mark.parametrize("table", sorted(OWNERS))
def test_only_the_owner_names_the_table_in_sql(table: str) -> None:
    assert (ROOT / OWNERS[table]).is_file()
    found = [o for o in offenders(table, OWNERS[table]) if o.rpartition(":")[0] not in NOT_YET_CONVERTED]
    assert found == [], f"lr.{table} is named outside {OWNERS[table]}"


def test_the_checker_flags_an_offender(tmp_path: Path) -> None:
    module = tmp_path / "offender.py"
    module.write_text(
        '"""Reads lr.sink_sessions (a docstring may say so)."""\n'
        "def read(cur, table):\n"
        '    """So may this one: lr.sink_sessions."""\n'
        '    cur.execute("SELECT 1 FROM lr.sink_sessions")\n'
        '    cur.execute(f"SELECT {table} FROM lr.sink_sessions_old")\n'
        '    cur.execute(f"DELETE FROM lr.sink_sessions WHERE {table}")\n'
    )
    assert offenders("sink_sessions", "elsewhere.py", tmp_path, [module]) == ["offender.py:4", "offender.py:6"]
