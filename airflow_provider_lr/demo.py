"""``lr demo``: bring up embedded sites, install lr on them and show what replication does."""
from __future__ import annotations

from airflow_provider_lr.engine import schema
from airflow_provider_lr.sites import SiteManager


def run(manager: SiteManager, sink_count: int = 2) -> int:
    print(f"lr demo: starting {sink_count + 1} embedded PostgreSQL sites under {manager.home}")
    sites = manager.up(count=sink_count + 1)
    for site in sites:
        conn = site.conninfo().connect()
        try:
            result = schema.init_site(conn, site.site_id, site.region)
        finally:
            conn.close()
        print(f"  {site.site_id} ({site.region}) port {site.port}: lr schema v{result.version}")
    print("\nsites are left running; stop them with: lr sites down")
    return 0
