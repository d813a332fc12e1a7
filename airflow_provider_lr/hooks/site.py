"""Airflow hook for an lr site: resolves an Airflow connection to the engine's connection info."""

from __future__ import annotations

from typing import Any

import psycopg2.extensions
from airflow.sdk import BaseHook

from airflow_provider_lr.engine.db import conninfo, schema
from airflow_provider_lr.engine.db.timeouts import DEFAULT, Purpose, Timeouts
from airflow_provider_lr.engine.errors import ConfigurationError, one_line


def as_dict(conn: Any) -> dict[str, Any]:
    """An Airflow connection in its JSON form (what ``AIRFLOW_CONN_*`` and the connections file hold)."""
    return {
        "conn_type": conn.conn_type,
        "host": conn.host,
        "port": conn.port,
        "login": conn.login,
        "password": conn.password,
        "schema": conn.schema,
        "extra": conn.extra_dejson,
    }


class ConnectionMissing(ConfigurationError):
    """An Airflow connection a site is reached through is not defined where the task (or the
    triggerer) runs. No retry mends it: lr's tasks fail at once on it (``operators/common``)."""


def missing(conn_id: str) -> ConnectionMissing:
    """What a user meets when ``conn_id`` is not defined: which connection, and where to define it.
    Before, Airflow's ``The conn_id `lr_site_c` isn't defined`` under a traceback, retried."""
    return ConnectionMissing(
        f"Airflow connection {conn_id!r} is not defined: create it (Admin > Connections, type 'lr site', "
        f"or AIRFLOW_CONN_{conn_id.upper()}, or your secrets backend) where the tasks and the triggerer "
        "run, or fix the site's conn_id in the topology"
    )


class LRSiteHook(BaseHook):
    """A site's PostgreSQL, from an ``lr_site`` (or plain ``postgres``) connection.

    The engine speaks psycopg2, so this hook hands it libpq parameters built from the connection
    (host, port, login, password, schema, extras) plus the site id and region extras.

    ``get_conn`` and ``connect_site`` are for the application's own statements (a DAG's task that
    writes its tables and transmits): the site's search_path, network bounds only, as on any
    connection of the application's. lr's operators take ``connect_replication``: lr's bounds, and a
    search_path of pg_catalog alone (no function of another schema stands in for a built-in in lr's
    statements; every other name is qualified there).
    """

    conn_name_attr = "lr_conn_id"
    default_conn_name = "lr_default"
    conn_type = "lr_site"
    hook_name = "lr site (PostgreSQL)"

    def __init__(self, lr_conn_id: str = default_conn_name, timeouts: Timeouts | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lr_conn_id = lr_conn_id
        self.timeouts = timeouts or DEFAULT  # the topology's bounds on the connection (``topology.timeouts``)

    def connection_dict(self) -> dict[str, Any]:
        """The connection in Airflow's JSON form (secrets included: write it only to 0600 files)."""
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            return as_dict(self.get_connection(self.lr_conn_id))
        except AirflowNotFoundException:
            raise missing(self.lr_conn_id) from None

    def get_conninfo(self) -> conninfo.ConnInfo:
        return conninfo.from_airflow_dict(self.connection_dict(), self.lr_conn_id).with_timeouts(self.timeouts)

    async def aget_conninfo(self) -> conninfo.ConnInfo:
        """For triggers: resolve the connection without blocking the triggerer's event loop."""
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            conn = await self.aget_connection(self.lr_conn_id)
        except AirflowNotFoundException:
            raise missing(self.lr_conn_id) from None
        return conninfo.from_airflow_dict(as_dict(conn), self.lr_conn_id).with_timeouts(self.timeouts)

    def get_conn(self) -> psycopg2.extensions.connection:
        """A connection for the application's statements (see the class docstring)."""
        return self.get_conninfo().connect(Purpose.APPLICATION)

    def connect_site(self, site_id: str, purpose: Purpose = Purpose.APPLICATION) -> psycopg2.extensions.connection:
        """Connect and check the database is the site the topology means: a connection pointing at
        the wrong database must not be written to. For the application's statements by default."""
        conn = self.get_conninfo().connect(purpose)
        try:
            found = schema.site_identity(conn)[0]
            conn.rollback()
        except BaseException:
            conn.close()
            raise
        if found != site_id:
            conn.close()
            raise ConfigurationError(
                f"connection {self.lr_conn_id!r} points at site {found!r}, but the topology expects {site_id!r} "
                f"there; fix the connection or the site's conn_id in the topology"
            )
        return conn

    def connect_replication(self, site_id: str) -> psycopg2.extensions.connection:
        """``connect_site`` for lr's own work (its operators, sensors, the engine): lr's bounds and a
        search_path of pg_catalog alone."""
        return self.connect_site(site_id, Purpose.SESSION)

    def test_connection(self) -> tuple[bool, str]:
        try:
            conn = self.get_conn()
        except Exception as exc:  # the UI shows the message
            return False, one_line(exc)
        try:
            version = schema.current_version(conn)
        finally:
            conn.close()
        if version == 0:
            return True, "Connected; lr is not installed on this database yet (run `lr init`)"
        return True, f"Connected; lr schema version {version}"
