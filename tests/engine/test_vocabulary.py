"""The shared vocabulary matches what the schema stores and checks: a state, status, stream or lock
key added in one place only fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import airflow_provider_lr
from airflow_provider_lr.engine import vocabulary
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.vocabulary import (
    COMMIT_LOCK_KEY,
    STREAM_NAMES,
    RequestStatus,
    SessionKey,
    SessionState,
    receive_queue_name,
)
from tests.support.session import App, apply, empty_provider, replicator


def _check_values(site, table: str, column: str) -> set[str]:
    """The quoted literals of the CHECK constraint on ``lr.<table>.<column>`` alone of a migrated site
    (not one that also reads other columns, as log_entries' bound on a message's size does)."""
    rows = site.query(
        """
        SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c
        JOIN pg_attribute a ON a.attrelid = c.conrelid AND c.conkey = ARRAY[a.attnum]
        WHERE c.contype = 'c' AND c.conrelid = %s::regclass AND a.attname = %s
        """,
        (f"lr.{table}", column),
    )
    assert len(rows) == 1, rows
    definition = rows[0][0]
    return set(re.findall(r"'([^']*)'", definition)) or set(re.findall(r"\b(\d+)\b", definition))


def test_session_states_are_exactly_what_the_schema_allows(lr_sites):
    assert _check_values(lr_sites[0], "source_sessions", "state") == {s.value for s in SessionState}


def test_request_statuses_are_exactly_what_the_schema_allows(lr_sites):
    assert _check_values(lr_sites[0], "full_sync_requests", "status") == {s.value for s in RequestStatus}


def test_streams_are_exactly_what_the_schema_allows(lr_sites):
    assert _check_values(lr_sites[0], "log_entries", "stream") == {str(s) for s in STREAM_NAMES}


def test_commit_trigger_takes_the_commit_lock_key(lr_sites):
    """The migration writes the key as a literal (migrations are checksummed and cannot import it)."""
    bodies = [
        r[0]
        for r in lr_sites[0].query(
            "SELECT prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'lr' AND prosrc LIKE %s",
            ("%advisory_xact_lock_shared%",),
        )
    ]
    assert bodies and all(f"pg_advisory_xact_lock_shared({COMMIT_LOCK_KEY})" in b for b in bodies)


def test_lock_keys_are_distinct():
    keys = [
        vocabulary.SCHEMA_LOCK_KEY,
        vocabulary.COMMIT_LOCK_KEY,
        vocabulary.CONSUMER_LOCK_CLASS,
        vocabulary.STAGING_LOCK_CLASS,
        vocabulary.MEMBER_LOCK_CLASS,
    ]
    assert len(set(keys)) == len(keys)


def test_session_key_has_one_spelling_and_reads_back():
    key = SessionKey("site-a", "site-b", "policy_v2")
    assert str(key) == "site-a->site-b/policy_v2"
    assert SessionKey.parse(str(key)) == key
    with pytest.raises(ValueError):
        SessionKey.parse("site-b/policy")


def test_wakeup_payload_reads_back_with_any_site_or_client_name():
    for client, source in [("policy", "site-a"), ("a_b", "site_c-1"), ("x", "y")]:
        assert vocabulary.parse_wakeup(vocabulary.wakeup_payload(client, source)) == (client, source)


def test_open_statuses_sql_lists_the_open_statuses():
    assert vocabulary.OPEN_STATUSES_SQL == "('pending', 'supplied')"
    assert set(vocabulary.OPEN_STATUSES) < set(RequestStatus)


def test_receive_queue_name_is_the_one_the_sink_registers(lr_sites):
    """A session's first batch registers the sink's queue under ``receive_queue_name``."""
    source, sink = lr_sites[0], lr_sites[1]
    topo = apply(lr_sites, [{"source": source.site_id, "sinks": [sink.site_id], "clients": ["policy"]}])
    app = App(source)
    app.put("k", 1, [sink.site_id])
    app.close()
    run_until_idle(replicator(topo, lr_sites, providers={"policy": empty_provider}))
    names = {r[0] for r in sink.query("SELECT stream_name FROM lr.registry WHERE kind = 'receive_queue'")}
    assert names == {receive_queue_name("policy", source.site_id)}


def test_failover_statuses_are_exactly_what_the_schema_allows(lr_sites):
    assert _check_values(lr_sites[0], "failovers", "status") == {s.value for s in vocabulary.FailoverStatus}


def test_consumed_trigger_skips_under_the_reconciling_setting(lr_sites):
    bodies = [r[0] for r in lr_sites[0].query("SELECT prosrc FROM pg_proc WHERE proname = 'note_consumed'")]
    assert bodies and f"current_setting('{vocabulary.RECONCILING_SETTING}', true)" in bodies[0]


# --- every word has a writer -----------------------------------------------------------------------
PACKAGE = Path(airflow_provider_lr.__file__).parent
ENUM_BASES = {"Enum", "_Word"}  # enum.Enum, str-Enums, and vocabulary's stored words
# Members the schema writes, not Python: (enum, member) -> the migration text that writes it.
SCHEMA_WRITES = {("SessionState", "INITIALIZED"): r"\bstate\s+text NOT NULL DEFAULT 'INITIALIZED'"}


def _modules() -> dict[Path, ast.Module]:
    return {
        path: ast.parse(path.read_text(), str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "proto" not in path.relative_to(PACKAGE).parts
    }  # generated protobuf code


def _enums(modules: dict[Path, ast.Module]) -> dict[str, list[str]]:
    """Every enum class of lr (by name) and its members, read from the source."""
    found: dict[str, list[str]] = {}
    for tree in modules.values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
            if bases & ENUM_BASES:
                members = [
                    t.id
                    for stmt in node.body
                    if isinstance(stmt, ast.Assign)
                    for t in stmt.targets
                    if isinstance(t, ast.Name) and t.id.isupper()
                ]
                if members:
                    assert node.name not in found, f"two enums named {node.name}: the check cannot tell them apart"
                    found[node.name] = members
    return found


def _written(modules: dict[Path, ast.Module], enums: dict[str, list[str]]) -> set[tuple[str, str]]:
    """(enum, member) for every ``Enum.MEMBER`` (or ``module.Enum.MEMBER``) that is assigned, passed,
    returned or stored: not an operand of a comparison, nor a key of a mapping that translates it."""
    written: set[tuple[str, str]] = set()
    for tree in modules.values():
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
            if owner not in enums or node.attr not in enums[owner]:
                continue
            child, parent = node, parents.get(node)
            while parent is not None and not isinstance(parent, (ast.stmt, ast.Compare)):
                if isinstance(parent, ast.Dict) and child in parent.keys:
                    break
                child, parent = parent, parents.get(parent)
            else:
                if not isinstance(parent, ast.Compare):
                    written.add((owner, node.attr))
    return written


def test_every_state_and_decision_has_a_writer():
    """A member nothing writes is a word that tells a reader of a branch on it something that never
    happens: delete it, or write it where the state really occurs."""
    modules = _modules()
    enums = _enums(modules)
    assert {"SessionState", "RequestStatus", "Decision", "CatchupPath", "TriggerStatus"} <= set(enums)
    written = _written(modules, enums)
    migrations = "\n".join(m.sql for m in schema.available_migrations())
    for (name, member), pattern in SCHEMA_WRITES.items():
        assert re.search(pattern, migrations), f"{name}.{member}: the schema no longer writes it ({pattern})"
    unwritten = sorted(
        f"{name}.{member}"
        for name, members in enums.items()
        for member in members
        if (name, member) not in written and (name, member) not in SCHEMA_WRITES
    )
    assert not unwritten, f"enum members nothing in airflow_provider_lr/ writes: {unwritten}"
