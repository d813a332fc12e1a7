"""Where lr's files live: its local state directory and its shipped non-Python files.

The state directory (``lr_home``) is read by the engine (the connections file) and written by the
embedded tooling, so the rule lives here, below both. Shipped files (topology, DAGs, Spark jobs,
protos) sit beside the package in a source checkout or editable install; a wheel installs them under
``<prefix>/share/airflow-provider-lr``. ``LR_SHARE_DIR`` overrides both. The migrations are package
data (``airflow_provider_lr.migrations``), read with ``importlib.resources`` by ``engine/db/schema``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parent.parent
LR_HOME_ENV = "LR_HOME"


def lr_home() -> Path:
    """lr's local state directory: ``$LR_HOME``, by default ``./.lr`` (embedded sites, connections)."""
    return Path(os.environ.get(LR_HOME_ENV) or Path.cwd() / ".lr").resolve()


def home_unset_hint(looked: Path) -> str:
    """Said where lr found nothing under ``looked`` with ``$LR_HOME`` unset: its default is the
    current directory's ``.lr``, so an ``lr`` run from another directory than ``lr sites up`` finds
    no sites or connections, and said only ``start some`` or ``add it``."""
    if os.environ.get(LR_HOME_ENV) or looked.exists():
        return ""
    return (
        f"$LR_HOME is not set, so lr looks in {Path.cwd() / '.lr'}, the current directory's: run lr in the "
        "directory where `lr sites up` ran, or give it with --home or LR_HOME"
    )


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


def dags_dir() -> Path:
    return share_dir() / "dags"


def spark_jobs_dir() -> Path:
    return share_dir() / "spark_jobs"


def write_replacing(path: str | Path, text: str, mode: int = 0o644) -> Path:
    """Write ``text`` as ``path`` with ``mode``: to a new file beside it, then moved into place. A
    link planted at the name is replaced, never written through; a reader never sees half a file;
    a file that may hold a password is never readable by others, even for a moment (``0o600``)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(staged, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
        raise
    return out
