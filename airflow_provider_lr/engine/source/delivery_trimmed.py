"""The sinks that acknowledged an entry a trim already removed (``delivery.delivered``'s last
resort), read from the sessions' acknowledgements instead of the entry."""

from __future__ import annotations

import psycopg2.extensions

from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.store import source_sessions


def acknowledged_before_trim(
    conn: psycopg2.extensions.connection, client: str, position: int, wanted: list[str], asks_regions: bool
) -> tuple[dict[str, str], dict[str, int]] | None:
    """(sink -> region, sink -> acknowledged position) of the sinks that acknowledged the entry at
    ``position`` that a trim removed (``wanted``, else every sink of ``client``); None when the entry
    is not behind the trim mark. A safe trim (``lr_maintenance``, ``lr trim``) removes only what
    every sink acknowledged: a sensor that polled after it failed with "no log entry" for an entry
    safe everywhere. The sinks it named are gone with it, so a wait for regions must name them
    (``wanted``); a sink that did not acknowledge it (a retention trim passed it) is named."""
    with conn.cursor() as cur:
        cur.execute("SELECT trim_mark FROM lr.log_trim")
        mark = cur.fetchone()[0]
        acked = source_sessions.acked_positions(cur, client)
    conn.commit()
    if position > mark or not acked:
        return None
    unknown = sorted(set(wanted) - set(acked))
    if unknown:
        raise ConfigurationError(f"{unknown} are not sinks of client {client!r} at this site")
    behind = sorted(s for s in wanted or acked if acked[s] < position)
    if behind:
        raise ConfigurationError(
            f"the log entries of client {client!r} at commit position {position} were trimmed (trim mark {mark}) "
            f"before {behind} acknowledged them (a retention trim): those sinks get the client's state through a "
            "full sync, not this entry"
        )
    if not wanted and asks_regions:
        raise ConfigurationError(
            f"the log entries of client {client!r} at commit position {position} were trimmed (trim mark {mark}) "
            "after every sink acknowledged them: safe on every sink they named, but which sinks (and regions) "
            "can no longer be read; name the destinations to wait on"
        )
    sinks = list(wanted or acked)
    with conn.cursor() as cur:
        cur.execute("SELECT site_id, region FROM lr.remote_sites WHERE site_id = ANY (%s)", (sinks,))
        regions = dict(cur.fetchall())
    conn.commit()
    return regions, {s: acked[s] for s in sinks}
