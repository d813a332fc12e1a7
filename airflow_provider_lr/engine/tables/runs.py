"""A run of a sink transaction's table changes and the one set statement that applies it.

``ChangeApplier`` (``tables/sink``) cuts the changes it is given into runs: consecutive changes of
one table, all deletes, all key changes (old keys with their new ones, V0049) or all upserts, no
key twice among the upserts; ``compose`` writes the
statement that applies a run with the effect of applying its changes one by one, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from psycopg2 import sql

from airflow_provider_lr.engine.tables.definition import Column, TableDefinition
from airflow_provider_lr.engine.tables.targets import Target
from airflow_provider_lr.engine.tables.upsert import ledger, moved, on_conflict


@dataclass
class Run:
    """Consecutive changes of one table, all deletes or all upserts, no key twice among the
    upserts: one statement applies them with the effect of applying them one by one in order.
    ``docs[n]`` contributes its rows ``lo[n]..hi[n]`` (1-based)."""

    tid: int
    op: str
    text: tuple[str, ...]  # columns the entries carry as their text form (see V0015)
    absent: tuple[str, ...] = ()  # the sink's columns its upserts' rows do not carry (``_queue``)
    docs: list[bytes] = field(default_factory=list)
    lo: list[int] = field(default_factory=list)
    hi: list[int] = field(default_factory=list)
    keys: set = field(default_factory=set)
    layers: list[int] = field(default_factory=list)  # a key change's: each row's (``layers``), or none

    def take(self, doc: bytes, row: int) -> None:
        if self.docs and self.docs[-1] is doc and self.hi[-1] == row - 1:
            self.hi[-1] = row
        else:
            self.docs.append(doc)
            self.lo.append(row)
            self.hi.append(row)


# The most layers a statement's key changes are moved in (``layers``): each layer's statement reads
# the run's rows again, so a longer chain (``SET id = id + 1`` over a whole table) is moved as before:
# its rows deleted, then inserted by the upsert that follows (a sink's NOT DEFERRABLE foreign key to
# them refuses it, naming itself and the ALTER that lets it through: ``refusals``)
MAX_LAYERS = 32


def layers(olds: Sequence[object], news: Sequence[object]) -> list[int]:
    """The layer of each key change of one statement (old keys ``olds``, new ones ``news``, as
    ``_key`` makes them), so that applied layer after layer no row is moved onto a key before the
    row holding it left it: a row moving onto another's old key is a layer above it (a chain ``id +
    1``: 3 -> 4 first, then 2 -> 3, then 1 -> 2, the order the source's immediate key took). The
    moves of a cycle (a swap) meet each other whatever the order: layer 0, where ``_moves`` deletes
    them as before. None (``[]``: one layer) when no move waits for another, a key is old twice, or
    the chain is ``MAX_LAYERS`` long or more."""
    at = {k: i for i, k in enumerate(olds)}
    if len(at) < len(olds) or len(news) != len(olds):
        return []
    after = [at.get(k) for k in news]  # the move that must go first
    layer: list[int | None] = [None] * len(olds)
    for start in range(len(olds)):
        path: list[int] = []
        on: dict[int, int] = {}
        j = start if layer[start] is None else None
        while j is not None and layer[j] is None and j not in on:
            on[j] = len(path)
            path.append(j)
            j = after[j]
        if j is not None and j in on:  # a cycle
            for c in path[on[j] :]:
                layer[c] = 0
            path = path[: on[j]]
        below = -1 if j is None else layer[j]
        assert below is not None
        for p in reversed(path):
            below += 1
            layer[p] = below
    depth = max((x or 0 for x in layer), default=0)
    return [x or 0 for x in layer] if 0 < depth < MAX_LAYERS else []


def compose(target: Target, run: Run, as_text: bool) -> sql.Composed:
    """The statement that applies ``run`` to ``target`` (its parameters: ``flush``'s). Its text is a
    format for ``mogrify``, where ``%`` starts a parameter: a column named ``50%`` (or ``%(docs)s``) is
    composed with its ``%`` doubled, which ``mogrify`` turns back into one. ``as_text``: the changes
    come as text (``ChangeApplier.flush``), else as bytea."""
    target = replace(target, definition=_percent_doubled(target.definition), always=tuple(map(_doubled, target.always)))
    d = target.definition
    types = {c.name: c.type for c in d.columns}
    # A column of a type outside pg_catalog (printed with its schema: a domain, an enum) is cast from
    # the row's text of it, like the columns that travel as text, never read through a record of the
    # table's type: that record's columns a row does not carry (a delete's, the text ones) are NULL,
    # which a NOT NULL domain refuses (every change of such a table was refused, for good).
    carried_as_text = {_doubled(c) for c in run.text}
    own = {c for c in d.column_names if "." in types[c]} - carried_as_text
    text = carried_as_text | own
    record = sql.SQL("pg_catalog.jsonb_populate_record(NULL::{}, r.d - %(text)s::pg_catalog.text[])").format(
        d.table.ident
    )
    picked: dict[str, sql.Identifier] = {}  # with ``own``: the other columns, each by an alias of lr's
    lateral: sql.Composable = sql.SQL("")
    more: sql.Composable = sql.SQL("")
    if own:  # the other columns by a record of their own types (q.c, never q alone: a column may be named q)
        picked = {c: sql.Identifier(f"lr_{n}") for n, c in enumerate(c for c in d.column_names if c not in text)}
        record = sql.SQL("NULL::pg_catalog.text")  # p unused: the picked columns follow r.d in the row
        more = sql.Composed([sql.SQL(", q.{} AS {}").format(sql.Identifier(c), a) for c, a in picked.items()])
        if picked:
            lateral = sql.SQL("CROSS JOIN LATERAL pg_catalog.jsonb_to_record(r.d) AS q({}) ").format(
                sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(types[c])) for c in picked)
            )
    if run.op == "k":  # a key change's new key, paired with the old one (r.d) by its place in the entry, and its layer
        more = sql.SQL(
            "{}, (j.lr_j -> 'to' -> (r.i::int - 1)) AS n, "
            "COALESCE((%(layers)s::pg_catalog.int4[])[r.i::int], 0) AS lr_l"
        ).format(more)
    rows = sql.SQL(  # ORDER BY: the source's order, and the subquery is not pulled up (p computed once)
        "SELECT {p} AS p, r.d{more} "
        "FROM ROWS FROM (pg_catalog.unnest(%(docs)s::{docs}[]), pg_catalog.unnest(%(lo)s::int[]), "
        "pg_catalog.unnest(%(hi)s::int[])) WITH ORDINALITY AS t(doc, lo, hi, ord) "
        "CROSS JOIN LATERAL (SELECT {doc}::pg_catalog.jsonb AS lr_j OFFSET 0) AS j "
        "CROSS JOIN LATERAL pg_catalog.jsonb_array_elements(j.lr_j -> 'rows') "
        "WITH ORDINALITY AS r(d, i) {lateral}"
        "WHERE r.i BETWEEN t.lo AND t.hi ORDER BY t.ord, r.i"
    ).format(
        p=record,
        more=more,
        lateral=lateral,
        docs=sql.SQL("pg_catalog.text" if as_text else "pg_catalog.bytea"),
        doc=sql.SQL("t.doc" if as_text else "pg_catalog.convert_from(t.doc, 'UTF8')"),
    )

    def value(col: str) -> sql.Composable:  # a column of row s: from the record, or cast from its text
        if col in text:
            return sql.SQL("(s.d ->> {})::{}").format(sql.Literal(col), sql.SQL(types[col]))
        if col in picked:
            return sql.SQL("s.{}").format(picked[col])
        return sql.SQL("(s.p).{}").format(sql.Identifier(col))

    if run.op == "d":
        x_key = sql.SQL(", ").join(sql.SQL("x.{}").format(sql.Identifier(k)) for k in d.key)
        s_key = sql.SQL(", ").join(value(k) for k in d.key)
        statement = sql.SQL("DELETE FROM {t} x USING ({rows}) s WHERE ({xk}) OPERATOR(pg_catalog.=) ({sk})").format(
            t=d.table.ident, rows=rows, xk=x_key, sk=s_key
        )
    elif run.op == "k":
        statement = _moves(target, rows, value, types, max(run.layers, default=0))
    else:
        absent = tuple(map(_doubled, run.absent))  # the sink's default on insert, kept on update
        carried = [c for c in d.column_names if c not in absent]
        cols = sql.SQL(", ").join(map(sql.Identifier, carried))
        s_cols = sql.SQL(", ").join(value(c) for c in carried)
        x_key = sql.SQL(", ").join(sql.SQL("x.{}").format(sql.Identifier(k)) for k in d.key)
        s_key = sql.SQL(", ").join(value(k) for k in d.key)
        same = sql.SQL("({}) OPERATOR(pg_catalog.=) ({})").format(x_key, s_key)
        # a GENERATED ALWAYS identity (not the key) no update may set: a row with another value of it
        # is deleted, then inserted with the source's (``upsert.moved``); none: nothing more
        first = moved(target, sql.SQL("({})").format(rows), same, value, absent)
        statement = sql.SQL(  # the source's values, an identity GENERATED ALWAYS's too
            "{first}INSERT INTO {t} ({cols}) OVERRIDING SYSTEM VALUE SELECT {s_cols} FROM ({rows}) s {conflict}"
        ).format(
            first=first,
            t=d.table.ident,
            cols=cols,
            s_cols=s_cols,
            rows=rows,
            conflict=on_conflict(d, absent + target.always),
        )
        if target.deferrable_key:  # no arbiter for ON CONFLICT: the run's one row updated, or inserted if new
            rest = [c for c in carried if c not in d.key and c not in target.always]
            update = (
                sql.SQL("UPDATE {t} x SET ({rest}) = ROW({vals}) FROM ({rows}) s WHERE {same}; ").format(
                    t=d.table.ident,
                    rest=sql.SQL(", ").join(map(sql.Identifier, rest)),
                    vals=sql.SQL(", ").join(value(c) for c in rest),
                    rows=rows,
                    same=same,
                )
                if rest
                else sql.SQL("")
            )
            statement = sql.SQL(
                "{first}{update}INSERT INTO {t} ({cols}) OVERRIDING SYSTEM VALUE SELECT {s_cols} FROM ({rows}) s "
                "WHERE NOT EXISTS (SELECT FROM {t} x WHERE {same})"
            ).format(first=first, update=update, t=d.table.ident, cols=cols, s_cols=s_cols, rows=rows, same=same)
    if not target.shared:
        return statement
    keys = sql.SQL("SELECT {} AS key FROM ({}) s").format(target.key_object(sql.SQL("(s.p)"), value), rows)
    return sql.SQL("{}; {}").format(statement, ledger(target, keys, upserted=run.op == "u"))


def _moves(
    target: Target, rows: sql.Composable, value: Callable[[str], sql.Composable], types: dict[str, str], depth: int
) -> sql.Composed:
    """A key change's run (V0049): each row moved to its new key in place, by an UPDATE of its key
    columns (the sink's own ON UPDATE rules act, as the source's did: a NOT DEFERRABLE foreign key
    ON UPDATE CASCADE moves the children along), layer after layer (``layers``: one statement each,
    up to ``depth``), where that cannot meet another row's key: the new key is no other old key of
    the run not moved yet (a swap; a chain ``id + 1`` is one layer per link: the sink's immediate key
    would refuse the row met midway of a set UPDATE, in an order the source's did not run), no other
    row of the run moves onto it, no row of the sink holds it (it is the row's own when a deferrable
    key holds it twice: moved only when one row holds the old key), and the key is not ``GENERATED
    ALWAYS`` (no UPDATE may set it). Elsewhere the row is deleted, as entries without new keys are:
    the upsert that follows brings it back under its new key either way."""
    d = target.definition
    t, n = d.table.ident, range(len(d.key))
    old = [sql.Identifier(f"lr_o{i}") for i in n]
    new = [sql.Identifier(f"lr_n{i}") for i in n]

    def of(alias: str, names: Sequence[sql.Identifier]) -> sql.Composable:
        return sql.SQL("({})").format(sql.SQL(", ").join(sql.SQL(alias + ".{}").format(c) for c in names))

    x_key, keys = of("x", list(map(sql.Identifier, d.key))), list(map(sql.Identifier, d.key))
    pairs = sql.SQL(", ").join(
        [sql.SQL("{} AS {}").format(value(k), o) for k, o in zip(d.key, old)]
        + [sql.SQL("(s.n ->> {})::{} AS {}").format(sql.Literal(k), sql.SQL(types[k]), m) for k, m in zip(d.key, new)]
        + [sql.SQL("s.lr_l")]
    )
    movable = sql.SQL(
        "NOT EXISTS (SELECT FROM lr_k j WHERE {jo} OPERATOR(pg_catalog.=) {kn} AND j.lr_l >= lr_k.lr_l) "
        "AND NOT EXISTS (SELECT FROM lr_k j WHERE {jn} OPERATOR(pg_catalog.=) {kn} AND {jo} OPERATOR(pg_catalog.<>) {ko}) "
        "AND NOT EXISTS (SELECT FROM {t} y WHERE {yk} OPERATOR(pg_catalog.=) {kn})"
    ).format(jo=of("j", old), jn=of("j", new), ko=of("lr_k", old), kn=of("lr_k", new), t=t, yk=of("y", keys))
    if target.deferrable_key:
        movable = sql.SQL(
            "{} AND (SELECT pg_catalog.count(*) FROM {} y WHERE {} OPERATOR(pg_catalog.=) {}) = 1"
        ).format(movable, t, of("y", keys), of("lr_k", old))
    moving = ", lr_moved AS (UPDATE {t} x SET ({keys}) = ROW({kn}) FROM lr_k WHERE {at}{xk} OPERATOR(pg_catalog.=) {ko} AND {movable})"
    if target.key_always:  # a GENERATED ALWAYS key: no UPDATE may set it (refused as the statement is read)
        moving, movable, depth = "", sql.SQL("false"), 0
    statement = (
        "WITH lr_k AS MATERIALIZED (SELECT {pairs} FROM ({rows}) s)"
        + moving
        + " DELETE FROM {t} x USING lr_k WHERE {at}{xk} OPERATOR(pg_catalog.=) {ko} AND NOT ({movable})"
    )
    return sql.SQL("; ").join(
        sql.SQL(statement).format(
            pairs=pairs,
            rows=rows,
            t=t,
            keys=sql.SQL(", ").join(keys),
            kn=sql.SQL(", ").join(sql.SQL("lr_k.{}").format(m) for m in new),
            xk=x_key,
            ko=of("lr_k", old),
            movable=movable,
            at=sql.SQL("lr_k.lr_l = {} AND ").format(sql.Literal(layer)) if depth else sql.SQL(""),
        )
        for layer in range(depth + 1)
    )


def _doubled(name: str) -> str:
    return name.replace("%", "%%")


def _percent_doubled(d: TableDefinition) -> TableDefinition:
    """``d`` with every ``%`` of its column names and types doubled (``_compose``)."""
    columns = tuple(Column(_doubled(c.name), _doubled(c.type), c.not_null) for c in d.columns)
    return replace(d, columns=columns, key=tuple(map(_doubled, d.key)))
