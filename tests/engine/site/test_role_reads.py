"""What each lr role can read on a site (docs/security.md): a writer or consumer of client alpha
reads no row of client beta's, whatever lr table or view it names, and its own still."""

from __future__ import annotations

from psycopg2 import sql

from airflow_provider_lr.client import RoutingQueueClient
from tests.engine.site.test_roles import connect_as, made  # noqa: F401
from tests.support.session import apply

# what names a client in a row of an lr table or view
CLIENT_COLUMNS = ("client_name", "client", "client_id")


def _readable(conn) -> dict[str, list[dict]]:
    """Every lr table or view the login may SELECT some column of -> the rows it reads there."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT c.relname, array_agg(a.attname::text ORDER BY a.attnum) FROM pg_class c "
            "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
            "WHERE c.relnamespace = 'lr'::regnamespace AND c.relkind IN ('r', 'v', 'p', 'm') "
            "AND has_column_privilege(c.oid, a.attnum, 'SELECT') GROUP BY c.relname ORDER BY 1"
        )
        rows = {}
        for name, columns in cur.fetchall():
            cur.execute(
                sql.SQL("SELECT {} FROM {}").format(
                    sql.SQL(", ").join(map(sql.Identifier, columns)), sql.Identifier("lr", name)
                )
            )
            rows[name] = [dict(zip(columns, r)) for r in cur.fetchall()]
    conn.rollback()
    return rows


def test_a_writer_or_consumer_of_alpha_reads_no_row_of_beta_in_any_lr_table_or_view(lr_sites, made):
    """A writer of alpha read lr.source_sessions whole: beta's sinks and how far each had acknowledged
    (its SELECT covered every row, where the policies keep it from beta's log entries, requests and
    guards). Now the rows of its clients only, and its wait for delivery still reads them."""
    source, sink = lr_sites[0], lr_sites[1]
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["alpha", "beta"]}])
    writer, consumer = made.name("w_alpha"), made.name("c_alpha")
    made.grant(source, "writer", writer, ["alpha"])
    made.grant(sink, "consumer", consumer, ["alpha"])
    ids = dict(source.query("SELECT client_name, client_id FROM lr.clients"))
    for site, role in ((source, writer), (sink, consumer)):
        conn = connect_as(site, role)
        read = _readable(conn)
        conn.close()
        for name, rows in read.items():
            if name == "clients":  # the ids of the topology's clients, which every writer reads whole
                continue
            beta = [r for r in rows if any(r.get(c) in ("beta", ids["beta"]) for c in CLIENT_COLUMNS)]
            assert not beta, (role, name, beta)
        if role == writer:
            assert [(r["sink_site_id"], r["client_name"]) for r in read["source_sessions"]] == [("site-b", "alpha")]
    conn = connect_as(source, writer)  # transmit, and the wait for delivery reading alpha's acknowledgement
    client = RoutingQueueClient(conn, "alpha")
    ticket = client.transmit_log_entry_message(b"a", ["site-b"])
    conn.commit()
    assert client.delivery(ticket).acked == {"site-b": -1}  # its sink, read: nothing acknowledged yet
    conn.close()
