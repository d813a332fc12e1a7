"""``lr`` finds a site's ``conn_id`` among Airflow's own connections too.

The engine reads ``AIRFLOW_CONN_<ID>`` and the connections file only: it imports no Airflow. A
site whose connection an operator made in the Airflow UI (docs/airflow.md: *Admin → Connections*),
or that a secrets backend holds, was unknown to ``lr topology validate``, ``apply``, ``status`` and
``sync`` run on the same machine. When Airflow is installed and configured here (``$AIRFLOW_HOME``
set, or its default ``~/airflow/airflow.cfg`` present), the ``lr`` command asks it last, as a task
would; importing Airflow costs seconds, so only for an id found nowhere else.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from airflow_provider_lr.cli.common import environ_set
from airflow_provider_lr.engine.db import conninfo
from airflow_provider_lr.engine.errors import ConfigurationError, one_line

_LEVEL = "AIRFLOW__LOGGING__LOGGING_LEVEL"


def _configured() -> bool:
    """Airflow has a home here: importing it elsewhere would write a default one under ~/airflow."""
    return bool(os.environ.get("AIRFLOW_HOME")) or (Path.home() / "airflow" / "airflow.cfg").is_file()


@contextmanager
def _airflow_kept_quiet() -> Iterator[None]:
    """Importing Airflow configures logging for the whole process: its warnings (an ``lr_site``
    scheme has a '_') went to stdout, into ``lr status --json``'s document, and the root logger's
    handler lr set (stderr) was replaced. Airflow logs errors only here, and lr's handlers are put back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with environ_set(_LEVEL, "ERROR"):
            yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def airflow_connection(conn_id: str) -> conninfo.ConnInfo | None:
    """``conn_id`` as Airflow resolves it (secrets backends, environment, metadata database); None
    when Airflow is not installed or configured here, or holds no such connection."""
    if not _configured():
        return None
    with _airflow_kept_quiet():
        try:
            from airflow.models.connection import Connection
            from airflow.sdk.exceptions import AirflowNotFoundException

            from airflow_provider_lr.hooks.site import as_dict
        except ImportError:  # the CLI without the airflow extra
            return None
        try:
            conn = Connection.get_connection_from_secrets(conn_id)
        except AirflowNotFoundException:
            return None
        except Exception as exc:  # noqa: BLE001 - a metadata database down, a secrets backend refusing: said
            raise ConfigurationError(
                f"Airflow could not be asked for it: {type(exc).__name__}: {one_line(exc)}"
            ) from None
    return conninfo.from_airflow_dict(as_dict(conn), conn_id)
