"""Airflow hook for an lr site: resolves an Airflow connection to the engine's connection info."""
from __future__ import annotations

from typing import Any

import psycopg2.extensions
from airflow.sdk import BaseHook

from airflow_provider_lr.engine import conninfo, schema


class LRSiteHook(BaseHook):
    """A site's PostgreSQL, from an ``lr_site`` (or plain ``postgres``) connection.

    The engine speaks psycopg2, so this hook hands it libpq parameters built from the connection
    (host, port, login, password, schema, extras) plus the site id and region extras.
    """

    conn_name_attr = "lr_conn_id"
    default_conn_name = "lr_default"
    conn_type = "lr_site"
    hook_name = "lr site (PostgreSQL)"

    def __init__(self, lr_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lr_conn_id = lr_conn_id

    def get_conninfo(self) -> conninfo.ConnInfo:
        conn = self.get_connection(self.lr_conn_id)
        return conninfo.from_airflow_dict(
            {
                "host": conn.host,
                "port": conn.port,
                "login": conn.login,
                "password": conn.password,
                "schema": conn.schema,
                "extra": conn.extra_dejson,
            },
            self.lr_conn_id,
        )

    def get_conn(self) -> psycopg2.extensions.connection:
        return self.get_conninfo().connect()

    def test_connection(self) -> tuple[bool, str]:
        try:
            conn = self.get_conn()
        except Exception as exc:  # the UI shows the message
            return False, str(exc)
        try:
            version = schema.current_version(conn)
        finally:
            conn.close()
        if version == 0:
            return True, "Connected; lr is not installed on this database yet (run `lr init`)"
        return True, f"Connected; lr schema version {version}"
