"""Where lr's shipped non-Python files live (migrations, topology, DAGs, Spark jobs, protos).

In a source checkout or editable install they sit beside the package; a wheel installs them under
``<prefix>/share/airflow-provider-lr``. ``LR_SHARE_DIR`` overrides both.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parent.parent


def share_dir() -> Path:
    """The directory that holds ``include/``, ``dags/``, ``spark_jobs/`` and ``proto/``."""
    override = os.environ.get("LR_SHARE_DIR")
    if override:
        return Path(override)
    if (_SOURCE_ROOT / "include" / "migrations").is_dir():
        return _SOURCE_ROOT
    return Path(sys.prefix) / "share" / "airflow-provider-lr"


def include_dir() -> Path:
    return share_dir() / "include"


def migrations_dir() -> Path:
    return include_dir() / "migrations"


def dags_dir() -> Path:
    return share_dir() / "dags"


def spark_jobs_dir() -> Path:
    return share_dir() / "spark_jobs"
