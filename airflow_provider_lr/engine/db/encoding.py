"""lr's own text (a session's last error, a request's note, a dead letter's error) as a site can store it.

A site's database need not be UTF8 (a LATIN1 one), nor a connection's client encoding: psycopg2
encodes a parameter in the connection's encoding and the server converts a statement's whole text
to the database's, and a character either lacks (a sink's Cyrillic message, a euro sign, lr's own
ellipsis) failed the statement: the error was never recorded (``lr status`` said nothing of a
failing session), the dead letter never moved. Such a character is written as its escape instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg2.extensions
from psycopg2.extras import Json

from airflow_provider_lr.engine.errors import ConfigurationError

_ANY_CLIENT = {"UTF8", "UNICODE"}  # psycopg2's names of a connection that encodes every character
_ANY_SERVER = {"UTF8", "SQL_ASCII"}  # a database that takes every character (SQL_ASCII converts nothing)


def storable(conn: psycopg2.extensions.connection, text: str) -> str:
    """``text`` with each character ``conn``'s client encoding or its database's lacks escaped
    (``\\u20ac``): what a statement on ``conn`` can store; unchanged on a UTF8 site."""
    names = {conn.encoding} - _ANY_CLIENT
    server = conn.info.parameter_status("server_encoding")
    if server not in _ANY_SERVER:
        names.add(server or "SQL_ASCII")
    for name in names:
        codec = psycopg2.extensions.encodings.get(name, "ascii")
        text = text.encode(codec, "backslashreplace").decode(codec)
    return text


def json_text(value: Any) -> str:
    """``value`` as JSON text with every character as itself, not escaped: a SQL_ASCII database's
    JSON parser refuses a ``\\u`` escape beyond ASCII (a sink's column types naming a column "été"
    failed every cycle of its session there); any other database converts the characters as it
    does the rest of the statement."""
    return json.dumps(value, ensure_ascii=False)


def as_json(value: Any) -> Json:
    """``value`` as a JSON parameter, written by ``json_text``."""
    return Json(value, dumps=json_text)


def talking_utf8(
    connect: Callable[[str], psycopg2.extensions.connection],
) -> Callable[[str], psycopg2.extensions.connection]:
    """``connect`` whose connections talk UTF8, as lr's own do (``timeouts.libpq_params``): one an
    engine API caller's ``connect`` makes takes the site's default client encoding, and on a LATIN1
    one psycopg2 composes a column named "été" as "Ã©tÃ©" and cannot read one named "✓" at all (every
    change of such a table was refused at that site, for good). Set while the connection is new and
    idle (psycopg2 ends a transaction to set it); the text it reads is the same either way."""

    def connected(site: str) -> psycopg2.extensions.connection:
        conn = connect(site)
        idle = conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
        if conn.encoding not in _ANY_CLIENT and idle and not conn.closed:
            conn.set_client_encoding("UTF8")
        return conn

    return connected


def require_utf8(conn: psycopg2.extensions.connection, what: str) -> None:
    """Refuse ``what`` on a connection that does not talk UTF8 (an engine API caller's plain one,
    in the site's default client encoding): lr composes its statements in UTF8, which such a server
    reads in its own encoding, so a column named "été" became "Ã©tÃ©" and the change was refused as
    the sink's fault. Refused rather than switched: the connection may be inside the caller's
    transaction, which ``set_client_encoding`` would end."""
    if conn.encoding not in _ANY_CLIENT:
        raise ConfigurationError(
            f"{what}: the connection's client encoding is {conn.encoding}, not UTF8, and lr writes "
            "column names and values in UTF8: connect with client_encoding=UTF8, or call "
            "conn.set_client_encoding('UTF8') first (lr's own connections do)"
        )
