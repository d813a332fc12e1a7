"""A source's rows of a sink table cleared: before the table's snapshot, and on its TRUNCATE.

A sink table may hold rows of several sources (``tables.sink``'s rules): each clears only its own,
the primary origin the rows ``lr.table_row_origin`` does not list, any other source the rows it
lists under that source (and the list with them).
"""

from __future__ import annotations

from collections.abc import Sequence

from psycopg2 import sql

from airflow_provider_lr.engine.tables.targets import Target


def clearing(target: Target) -> sql.Composed:
    """The statements of ``clear``."""
    return sql.SQL("; ").join(_clearing(target))


def _clearing(target: Target) -> list[sql.Composed]:
    t, name = target.definition.table.ident, sql.Literal(str(target.table))
    if not target.shared:
        return [sql.SQL("DELETE FROM {}").format(t)]
    if target.primary:
        return [
            sql.SQL(
                "DELETE FROM {} x WHERE NOT EXISTS (SELECT 1 FROM lr.table_row_origin o WHERE o.table_name = {} "
                "AND o.key = {})"
            ).format(t, name, target.key_object(sql.Identifier("x")))
        ]
    return [
        sql.SQL(
            "DELETE FROM {} x USING lr.table_row_origin o WHERE o.table_name = {} AND o.source_site_id = {} "
            "AND o.key = {}"
        ).format(t, name, sql.Literal(target.source), target.key_object(sql.Identifier("x"))),
        sql.SQL("DELETE FROM lr.table_row_origin WHERE table_name = {} AND source_site_id = {}").format(
            name, sql.Literal(target.source)
        ),
    ]


def clearing_together(targets: Sequence[Target]) -> sql.Composed:
    """``clearing`` of several tables (one TRUNCATE statement's, at the source) as ONE statement: a
    foreign key between them (``NO ACTION``, the default) is checked at its end, as the source's
    TRUNCATE checked it; cleared one by one, a parent before its child was refused for good."""
    if len(targets) == 1:
        return clearing(targets[0])
    parts = [part for target in targets for part in _clearing(target)]
    return sql.SQL("WITH {} SELECT").format(
        sql.SQL(", ").join(
            sql.SQL("{} AS ({})").format(sql.Identifier(f"lr_clear_{n}"), p) for n, p in enumerate(parts)
        )
    )
