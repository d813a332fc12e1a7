"""ReplicationStatus of a site, readable at a glance: its sessions on both ends, lag, and what
holds its shared log back (DESIGN §6 property 1: whatever can stall replication is named)."""
from __future__ import annotations

from dataclasses import dataclass, field

import psycopg2.extensions

from airflow_provider_lr.engine import schema
from airflow_provider_lr.engine.log_reader import holdback

_COLUMNS = (
    "role", "source_site_id", "sink_site_id", "client_name", "sync_type", "status", "base_snapshot",
    "last_applied_position", "remaining_entries_to_send", "data_consistent", "state", "last_error",
)


@dataclass
class SiteStatus:
    site_id: str
    schema_version: int
    topology_config_id: str | None = None
    trim_mark: int = 0
    sessions: list[dict] = field(default_factory=list)
    held_back_by: list[str] = field(default_factory=list)


def site_status(conn: psycopg2.extensions.connection, site_id: str | None = None) -> SiteStatus:
    version = schema.current_version(conn)
    site_id = site_id or schema.site_identity(conn)[0]
    result = SiteStatus(site_id, version)
    if version < 3:
        return result
    with conn.cursor() as cur:
        cur.execute("SELECT topology_config_id FROM lr.topology")
        row = cur.fetchone()
        result.topology_config_id = row[0] if row else None
        cur.execute("SELECT trim_mark FROM lr.log_trim")
        result.trim_mark = cur.fetchone()[0]
        cur.execute(f"SELECT {', '.join(_COLUMNS)} FROM lr.replication_status ORDER BY 1, 2, 3, 4")
        result.sessions = [dict(zip(_COLUMNS, r)) for r in cur.fetchall()]
    conn.commit()
    if any(s["role"] == "source" for s in result.sessions):
        result.held_back_by = [h.describe() for h in holdback(conn)]
    return result


def render(status: SiteStatus) -> str:
    lines = [
        f"{status.site_id}: schema v{status.schema_version}, topology {status.topology_config_id or '(none applied)'}, "
        f"trim mark {status.trim_mark}"
    ]
    for s in status.sessions:
        session = f"{s['source_site_id']}->{s['sink_site_id']}/{s['client_name']}"
        detail = (
            f"remaining {s['remaining_entries_to_send']}, {s['state']}" if s["role"] == "source"
            else f"data consistent {s['data_consistent']}"
        )
        lines.append(
            f"  {s['role']:<6} {session:<32} {s['sync_type'] or '-':<9} {s['status']:<11} "
            f"base {s['base_snapshot']}, applied {s['last_applied_position']}, {detail}"
            + (f"\n         last error: {s['last_error']}" if s.get("last_error") else "")
        )
    for reason in status.held_back_by:
        lines.append(f"  held back: {reason}")
    return "\n".join(lines)
