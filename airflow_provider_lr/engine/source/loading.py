"""Functions an operator names in the topology or a DAG's form (``package.module:function``): a
client's full-sync provider, a bulk apply function."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from airflow_provider_lr.engine.errors import ConfigurationError, one_line


def load_function(target: str, what: str) -> Callable[..., Any]:
    """The function ``target`` names, ``package.module:function``; ``what`` says what it is for."""
    module_name, _, attr = target.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"cannot load {what} {target!r}: {one_line(exc)} (it must be importable where lr runs: "
            "install its package there or add it to PYTHONPATH)"
        ) from exc
    if not callable(found):
        raise ConfigurationError(f"{what} {target!r} is not callable")
    return found
