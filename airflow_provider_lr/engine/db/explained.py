"""What a failed step means, as the one line a session's status and ``lr sync`` show: which bound
of ``timeouts`` fired (a call cut by lr, a lock, statement or idle timeout), or that the site's lr
schema is missing, before the error itself."""

from __future__ import annotations

from typing import Any

import psycopg2
from psycopg2 import errorcodes
from psycopg2.extensions import parse_dsn

from airflow_provider_lr.engine.errors import SchemaError, TopologyMismatchError, error_line

# SQLSTATEs of the bounds (``timeouts``), and what each means for the session (one line each)
_EXPLAINED = {
    "55P03": "a lock lr needs is held by another transaction (lock_timeout)",
    "57014": "a statement ran past statement_timeout (or was cancelled)",
    "25P03": "the server ended a transaction left idle (idle_in_transaction_timeout)",
}
# undefined table, schema, function: of lr's own schema, the site was never `lr init`ed or is older
_MISSING = {"42P01", "3F000", "42883"}
_NOT_INSTALLED = "the site has no lr schema, or an older one than this lr: run `lr init` on it"


def raised_on(exc: BaseException | None) -> Any:
    """The connection ``exc`` was raised on, when it says: the one lr cut (``lr_connection``, a
    commit's error has no cursor) or its cursor's; None when it does not."""
    return getattr(exc, "lr_connection", None) or getattr(getattr(exc, "cursor", None), "connection", None)


def _not_allowed(exc: BaseException) -> str:
    """A step refused a privilege: who asked, and which steps need a replicator or the owner (an
    application's writer login given to ``lr sync`` was told only the owner's). A failover run by
    ``lr_failover`` over replicator logins (as docs/security.md advises for the DAGs) failed with
    ``permission denied for table failovers`` and nothing said why."""
    conn = raised_on(exc)
    try:  # its DSN is kept after a close (the step's connections are closed by the time it is said)
        params = parse_dsn(conn.dsn) if conn is not None else {}
    except (psycopg2.Error, AttributeError):
        params = {}
    user = params.get("user")
    who = f"role {user!r}" if user else "this connection's role"
    # which site refused: a session spans two, and a grant missing at its sink was told as if anywhere
    site = getattr(conn, "site", None)
    server = "{}:{}/{}".format(params.get("host", "?"), params.get("port", "5432"), params.get("dbname", "?"))
    where = f" on site {site!r} ({server})" if site else f" on {server}" if params else ""
    grant = f"`lr roles grant replicator --role {user} --site <that site>`" if user else "`lr roles grant replicator`"
    return (
        f"{who} lacks a privilege this step needs{where}: `lr sync`, `lr status`, `lr trim`, `lr full-sync` and "
        f"the DAGs run as a replicator ({grant}) or the owner of the lr schema; a failover, a rejoin, `lr init`, "
        "`lr topology apply`, `lr roles` and `lr tables open`/`close` run as the owner (of the table too, for "
        "`lr tables`); a replicator of federated tables needs their grants (docs/security.md)"
    )


def explain(exc: BaseException | None) -> str | None:
    """What a bound that fired means, or that the lr schema is missing, to prefix an error with; None
    for other errors. An error raised from one (a provider's failure wrapping a cut call) is
    explained by its cause."""
    while exc is not None:
        conn = raised_on(exc)
        if conn is not None and getattr(conn, "was_cut", False):
            if conn.cut_earlier:
                return (
                    f"{conn.describe()} not waited for: its server did not answer earlier in this command "
                    f"({conn.cut_earlier}), cut by lr"
                )
            return (
                f"{conn.describe()} gave no answer within its call deadline of {conn.cut_after_s:.0f} s: "
                "a stopped server or a stalled link, cut by lr"
            )
        code = getattr(exc, "pgcode", None) or ""
        if code in _MISSING:
            primary = getattr(getattr(exc, "diag", None), "message_primary", None) or ""
            if '"lr.' in primary or 'schema "lr"' in primary or " lr." in primary:
                return _NOT_INSTALLED
        elif code in _EXPLAINED:
            return _EXPLAINED[code]
        elif code == errorcodes.INSUFFICIENT_PRIVILEGE:
            return _not_allowed(exc)
        exc = exc.__cause__
    return None


def failure(exc: BaseException) -> str:
    """A failed step as the one line a session's status and ``lr sync`` show: what the bound that
    fired means (if one did), the error's type and its text."""
    why = explain(exc)
    return (f"{why}: " if why else "") + error_line(exc)


# what no retry mends, as the word a result carries out of the process that raised it (``refused_kind``)
PRIVILEGE = "insufficient_privilege"  # SQLSTATE 42501's name: a login without lr's grant
TOPOLOGY = "topology_mismatch"  # the sites run another topology than the file in hand


def refused_kind(exc: BaseException) -> str | None:
    """Whether ``exc`` is a failure no retry mends, and which (``PRIVILEGE``, ``TOPOLOGY``); None for
    any other. The one rule of lr's tasks (``operators/common.refused_for_good`` asks it of an
    exception; a Spark job's result carries it for each session and for the job, where only its
    words came back before and its operator retried a missing grant as if transient)."""
    if isinstance(exc, TopologyMismatchError):
        return TOPOLOGY
    if getattr(exc, "pgcode", None) == errorcodes.INSUFFICIENT_PRIVILEGE:
        return PRIVILEGE
    if isinstance(exc, SchemaError) and getattr(exc.__cause__, "pgcode", None) == errorcodes.INSUFFICIENT_PRIVILEGE:
        return PRIVILEGE  # a login without any of lr's grants cannot read the schema's version
    return None
