"""What a stream's check asks of its sinks about federated tables: which sessions lack a table.

A table federated (or its copy asked again) while a session streams calls for a table snapshot,
which only negotiation runs: the stream hands such a session back (``SourceStream._check``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

import psycopg2.extensions

from airflow_provider_lr.engine.session.sink_writers import SinkBusy
from airflow_provider_lr.engine.session.stream_member import Member
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables import snapshot as table_snapshot

Needed = dict[str, list[registry.FederatedTable]]  # the tables each client's session there lacks
Lacking = dict[str, Needed | Exception]


def tables_lacking(
    members: Collection[Member],
    federated: dict[str, list[registry.FederatedTable]],
    ask: Callable[[str, Callable[[psycopg2.extensions.connection], Needed]], Needed],
    source: str,
) -> Lacking:
    """Per sink site of ``members``: the clients whose sessions there lack a federated table, read in
    one round trip per site, not per session (or why it could not be read: each session there fails),
    asked by ``SinkWriters.ask``; a site busy writing is left out (asked at the next check)."""
    by_sink: dict[str, dict[str, list[registry.FederatedTable]]] = {}
    for member in members:
        by_sink.setdefault(member.key.sink, {})[member.key.client] = federated[member.key.client]
    out: Lacking = {}
    for sink, clients in by_sink.items():
        try:
            out[sink] = ask(sink, functools.partial(table_snapshot.needed_by_client, source=source, federated=clients))
        except SinkBusy:
            continue
        except Exception as exc:
            out[sink] = exc
    return out
