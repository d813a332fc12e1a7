"""Foreign keys between federated tables at a sink: which tables a snapshot writes together, and in
which order.

lr does not create foreign keys (``tables/create``), but a sink table the user made may have them,
as the source's have (parent/child, ``ON DELETE CASCADE``, a self-reference). A snapshot clears a
table's rows and copies the source's: written table by table in name order, a child copied before
its parent refused the snapshot (``ForeignKeyViolation``) on every cycle, for good; a parent
cleared after its child was copied cascaded the child's new rows away. So a snapshot at a sink:

* takes together every federated table of the session the sink links by a foreign key to one it
  lacks (``linked``): a child alone, copied as of a snapshot newer than its parent's rows at the
  sink, could reference a parent the sink does not hold yet;
* clears them children first, then copies them parents first, in one sink transaction
  (``load_order``).

PostgreSQL's own apply worker avoids the question with ``session_replication_role = replica``
(no foreign key checked, no cascade): that needs a superuser, and would silence the sink's own
triggers too. Changes (log-entry sync) need none of this: they are applied in the source's order,
which the source's foreign keys accepted (docs/tables.md, "Apply at the sink").
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import psycopg2.extensions

from airflow_provider_lr.engine.tables.definition import TableName

Edge = tuple[TableName, TableName]  # (the referencing table, the table it references)

_EDGES_SQL = """
SELECT cn.nspname, c.relname, pn.nspname, p.relname
FROM pg_catalog.pg_constraint k
JOIN pg_catalog.pg_class c ON c.oid = k.conrelid JOIN pg_catalog.pg_namespace cn ON cn.oid = c.relnamespace
JOIN pg_catalog.pg_class p ON p.oid = k.confrelid JOIN pg_catalog.pg_namespace pn ON pn.oid = p.relnamespace
WHERE k.contype = 'f' AND k.conrelid <> k.confrelid
  AND (cn.nspname || '.' || c.relname) = ANY (%(names)s) AND (pn.nspname || '.' || p.relname) = ANY (%(names)s)
"""


def edges(cur: psycopg2.extensions.cursor, tables: Iterable[TableName]) -> set[Edge]:
    """The foreign keys this site has between two of ``tables`` (a self-reference is no edge: one
    COPY loads the table whole, and its check runs at the statement's end)."""
    names = sorted({str(t) for t in tables})
    if len(names) < 2:
        return set()
    cur.execute(_EDGES_SQL, {"names": names})
    return {(TableName(a, b), TableName(c, d)) for a, b, c, d in cur.fetchall()}


def linked(lacking: Iterable[TableName], among: Iterable[TableName], found: set[Edge]) -> set[TableName]:
    """``lacking`` and every table of ``among`` linked to one of them through ``found``, either way."""
    within = set(among)
    taken = set(lacking)
    todo = list(taken)
    while todo:
        table = todo.pop()
        for child, parent in found:
            for other in (parent,) if child == table else (child,) if parent == table else ():
                if other in within and other not in taken:
                    taken.add(other)
                    todo.append(other)
    return taken


def load_order(tables: Sequence[TableName], found: set[Edge]) -> list[TableName]:
    """``tables``, each after the tables it references (by name where the keys leave a choice, and
    the members of a cycle by name: a cycle of foreign keys that are not deferrable loads only
    with its NULLs, which is the sink's own table's business). Clear them in the reverse order.
    Each edge is counted once (before, every step asked every edge of every table left: a full
    sync of a thousand tables spent seconds here, of three thousand a minute)."""
    left = sorted(set(tables))
    within = set(left)
    parents: dict[TableName, int] = dict.fromkeys(left, 0)  # each table's parents not yet loaded
    children: dict[TableName, list[TableName]] = {t: [] for t in left}
    for child, parent in found:
        if child in within and parent in within and child != parent:
            parents[child] += 1
            children[parent].append(child)
    ready = [t for t in left if parents[t] == 0]  # sorted: a heap already
    order: list[TableName] = []
    done: set[TableName] = set()
    by_name = iter(left)  # the first table left, by name: where a cycle is entered
    while len(order) < len(left):
        if ready:
            step = heapq.heappop(ready)
            if step in done:
                continue
        else:
            step = next(t for t in by_name if t not in done)
        order.append(step)
        done.add(step)
        for child in children[step]:
            parents[child] -= 1
            if parents[child] == 0 and child not in done:
                heapq.heappush(ready, child)
    return order


def write_groups(order: Sequence[TableName], found: set[Edge]) -> list[list[TableName]]:
    """``order`` (``load_order``'s) cut into the groups written together: each table with every
    table linked to it, in load order, a group where its first table is. The links are followed
    once for all (before, for every table of every group: a full sync of a thousand unlinked
    tables spent minutes here before writing a row)."""
    near: dict[TableName, set[TableName]] = {t: set() for t in order}
    for child, parent in found:
        if child in near and parent in near:
            near[child].add(parent)
            near[parent].add(child)
    group_of: dict[TableName, int] = {}
    groups: list[list[TableName]] = []
    for first in order:
        if first in group_of:
            continue
        group_of[first] = len(groups)
        todo = [first]
        while todo:
            for other in near[todo.pop()]:
                if other not in group_of:
                    group_of[other] = len(groups)
                    todo.append(other)
        groups.append([])
    for table in order:
        groups[group_of[table]].append(table)
    return groups
