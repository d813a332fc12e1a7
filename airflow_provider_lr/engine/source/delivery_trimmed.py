"""The delivery of an entry a trim already removed (``delivery.delivered``'s last resort), read
from the sessions' acknowledgements instead of the entry."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg2.extensions

from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.source.delivery import Delivery, DeliveryState, check_targets, durability_rule, wait_for
from airflow_provider_lr.engine.store import source_sessions


def trimmed_after_every_ack(
    conn: psycopg2.extensions.connection,
    client: str,
    position: int,
    source_region: str,
    destinations: Sequence[str],
    min_regions: int | None,
) -> Delivery | None:
    """The delivery of an entry a trim removed, read from the sessions' acknowledgements (None: the
    entry is not behind the trim mark). A safe trim (``lr_maintenance``, ``lr trim``) removes only
    what every sink acknowledged: a sensor that polled after it failed with "no log entry" for an
    entry safe everywhere. The sinks it named are gone with it, so the wait must name them
    (``destinations``) or ask for nothing beyond them; a sink that did not acknowledge it (a
    retention trim passed it) is named."""
    with conn.cursor() as cur:
        cur.execute("SELECT trim_mark FROM lr.log_trim")
        mark = cur.fetchone()[0]
        acked = source_sessions.acked_positions(cur, client)
    conn.commit()
    if position > mark or not acked:
        return None
    wanted = check_targets(destinations, min_regions)
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
    if not wanted and (min_regions or durability_rule(conn)):
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
    found = Delivery(
        position, source_region, dict.fromkeys(sinks, DeliveryState.SAFE), regions, {s: acked[s] for s in sinks}
    )
    return found if wait_for(regions, source_region, wanted, min_regions, durability_rule(conn)).met(found) else None
