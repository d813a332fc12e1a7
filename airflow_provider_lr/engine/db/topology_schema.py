"""The one schema of a topology document, and errors that name the file, line and key.

A topology is configuration that switches replication on and off, so it is read strictly:
unknown keys are refused (a misspelt ``replications:`` must not silently mean "replicate
nothing"), every value has a type (``clients: policy`` is not a list of six one-letter clients),
and settings are typed and bounded. Errors are one line: ``file:line: key: what is wrong``.

The schema is JSON Schema (draft 2020-12, validated with ``jsonschema``); ``docs/topology.md``
documents every key. Rules that need more than one value (a replication naming an unknown site,
a site replicating to itself, receive-queue names that would collide) are checked by
``topology.from_document`` and reported through the same :class:`Origin`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import psycopg2
import yaml
from psycopg2.extensions import parse_dsn

from airflow_provider_lr.engine.errors import CONTROL_CHARS, ConfigurationError, one_line

if TYPE_CHECKING:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import ValidationError

# Names become SQL literals, stream tags, queue names and file names: one pattern each, matched
# with fullmatch (``re.match`` with ``$`` lets a trailing newline through).
SITE_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
CLIENT_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
PROVIDER_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
# Text lr records and prints but never parses (a region, a connection id, a reason): one line, no
# control character (``errors.CONTROL_CHARS``); a region "r1\nsite-b: ..." printed a line of its own.
_PRINTABLE = f"[^{CONTROL_CHARS}]"
ONE_LINE_PATTERN = re.compile(_PRINTABLE + "*")
PRINTABLE_PATTERN = re.compile(_PRINTABLE + "{1,63}")  # a region
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
MAX_SITES = 4096


def valid_site_id(value: object) -> bool:
    return isinstance(value, str) and SITE_ID_PATTERN.fullmatch(value) is not None


def valid_client_name(value: object) -> bool:
    return isinstance(value, str) and CLIENT_NAME_PATTERN.fullmatch(value) is not None


def valid_region(value: object) -> bool:
    return isinstance(value, str) and PRINTABLE_PATTERN.fullmatch(value) is not None


def form_pattern(pattern: re.Pattern[str] | str) -> str:
    """A JSON Schema ``pattern`` a whole form value must match, read alike by Airflow's server (Python's
    ``re.search``) and the browser (a JS RegExp): ``^...$`` let ``'site-b\\n'`` through in Python
    (``$`` matches before a final newline) and ``\\Z`` is no JS; ``(?![\\s\\S])`` ends the value in both."""
    text = pattern if isinstance(pattern, str) else pattern.pattern
    return rf"^(?:{text})(?![\s\S])"


_SITE_ID = {"type": "string", "pattern": form_pattern(SITE_ID_PATTERN)}
_CLIENT = {"type": "string", "pattern": form_pattern(CLIENT_NAME_PATTERN)}
_POSITIVE_SECONDS = {"type": "number", "exclusiveMinimum": 0, "maximum": 86_400 * 365}
_COUNT = {"type": "integer", "minimum": 0}
_TIMEOUT = {"type": "number", "minimum": 0, "maximum": 86_400}  # seconds, 0: off
_PROBE = {"type": "integer", "minimum": 1, "maximum": 3600}

# name -> (schema, what it sets); the defaults live with the code that uses them.
SETTINGS: dict[str, tuple[dict, str]] = {
    "full_sync_data_timeout_s": (_POSITIVE_SECONDS, "seconds without client data before a full-sync request restarts"),
    "lease_seconds": (_POSITIVE_SECONDS, "session lease; a replicator that loses it is fenced"),
    "tee_min_backlog": (_COUNT, "lr sync and the DAG: larger backlogs are caught up by the read-once tee (0: off)"),
    "spark_min_backlog": (_COUNT, "lr_replication DAG: larger backlogs go through the Spark fan-out"),
    "table_spark_min_rows": (_COUNT, "the DAGs: federated-table snapshots of more rows go through the Spark job"),
    "snapshot_spark_min_entries": (_COUNT, "the DAGs: full-sync transfers of more entries go through the Spark job"),
    "fanout_tasks": (
        {"type": "integer", "minimum": 0, "maximum": 1024},
        "chunks the Spark fan-out tees at once (1: in order in one task; 0: by the cluster's cores)",
    ),
    "nearest_copy": (
        {"type": "boolean"},
        "a sink of a client of tables only may take its snapshot from a peer sink in its region",
    ),
    "peer_probe_delay_s": (_POSITIVE_SECONDS, "seconds the nearest peer has to answer before the next is asked"),
    "member_heartbeat_s": (_POSITIVE_SECONDS, "lr sync processes sharing sessions: seconds between heartbeats"),
    "member_dead_after_s": (
        _POSITIVE_SECONDS,
        "a replicator member whose heartbeat is this old is dead (its sessions are taken over)",
    ),
    "max_payload_bytes": (
        {"type": "integer", "minimum": 1, "maximum": MAX_PAYLOAD_BYTES},
        "largest payload transmit accepts on the sites of this topology",
    ),
    # the bounds on every connection lr opens (engine/db/timeouts.py; a DSN's own win)
    "connect_timeout_s": (_TIMEOUT, "a server that does not answer the connect within this fails it"),
    "keepalives_idle_s": (_PROBE, "an idle link is probed after this long"),
    "keepalives_interval_s": (_PROBE, "then probed again every this long"),
    "keepalives_count": (_PROBE, "and called dead after this many probes unanswered"),
    "tcp_user_timeout_s": (_TIMEOUT, "data sent and not acknowledged this long: the link is dead"),
    "statement_timeout_s": (_TIMEOUT, "one statement on a session connection; with the link check, a call's deadline"),
    "lock_timeout_s": (_TIMEOUT, "a session's wait for a lock another transaction holds"),
    "idle_in_transaction_timeout_s": (_TIMEOUT, "a session's transaction left open this long is ended by its server"),
    "bulk_statement_timeout_s": (_TIMEOUT, "one statement of a bulk move (0: none)"),
    "bulk_lock_timeout_s": (_TIMEOUT, "a bulk move's wait for a lock"),
}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "lr topology",
    "type": "object",
    "additionalProperties": False,
    "required": ["sites"],
    "properties": {
        "sites": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_SITES,  # an entry's tags, one per sink, are bounded by the database (V0046)
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["id"],
                "properties": {
                    "id": _SITE_ID,
                    "region": {"type": "string", "pattern": form_pattern(PRINTABLE_PATTERN)},
                    "conn_id": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": 250,
                        "pattern": form_pattern(ONE_LINE_PATTERN),
                    },
                },
            },
        },
        "replication": {
            "type": ["array", "null"],
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["source", "sinks", "clients"],
                "properties": {
                    "source": _SITE_ID,
                    "sinks": {"type": "array", "minItems": 1, "uniqueItems": True, "items": _SITE_ID},
                    "clients": {"type": "array", "minItems": 1, "uniqueItems": True, "items": _CLIENT},
                },
            },
        },
        "providers": {
            "type": ["object", "null"],
            "propertyNames": _CLIENT,
            "additionalProperties": {"type": "string", "pattern": form_pattern(PROVIDER_PATTERN)},
        },
        "settings": {
            "type": ["object", "null"],
            "additionalProperties": False,
            "properties": {name: schema for name, (schema, _) in SETTINGS.items()},
        },
        "durability": {  # checked further by durability.check_rule (docs/delivery.md)
            "type": ["object", "null"],
            "additionalProperties": False,
            "required": ["min_regions_for_durability"],
            "properties": {
                "min_regions_for_durability": {"type": "integer", "minimum": 1, "maximum": 1000},
                "ack_quorum": {"type": "integer", "minimum": 1, "maximum": 100_000},
                "write_quorum": {"type": "integer", "minimum": 1, "maximum": 100_000},
            },
        },
    },
}


@cache
def _validator() -> Draft202012Validator:
    """Built at the first document read: importing ``jsonschema`` (its format checkers pull in
    date and URI libraries) was most of every ``lr`` command's start, ``lr --help`` included."""
    from jsonschema import Draft202012Validator

    return Draft202012Validator(SCHEMA)


# a DSN (key=value or URI form) that carries a password: never stored in a topology document
# (a URI's user:password@, the password with an unescaped '/' too: libpq reads "user:pass" as host
# and port there, and the rest as the database; not a host:port/db?key=a@b)
_SECRET = re.compile(
    r"(?i)((?:\b|(?<=ssl))password\s*=)|(^[a-z][a-z0-9+.-]*://[^/@\s:]*:(?![^@\s]*/[^@\s]*\?)[^@\s]*@)"
)
_URI_START = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]*://")
_SECRET_KEYS = frozenset(("password", "sslpassword"))  # libpq's: a login's, a client key's passphrase


def holds_password(conn_id: str) -> bool:
    """Whether ``conn_id`` is a DSN that carries a password: as libpq reads it (a URI's query keys are
    percent-decoded), else by its text (a DSN libpq cannot parse may still hold one: a URI's
    password with an unescaped ``/``, read as a host and a port)."""
    try:
        parsed = parse_dsn(conn_id)
        if _SECRET_KEYS & parsed.keys():
            return True
        # a database name libpq reads as a connection string of its own (``dbname='postgresql://...'``)
        nested = parsed.get("dbname") or ""
        if nested != conn_id and ("=" in nested or "://" in nested) and holds_password(nested):
            return True
    except psycopg2.ProgrammingError:  # not a DSN (an Airflow connection id), or a malformed one
        pass
    try:  # as lr reads a URI (its host after the last '@'): a ``user@server`` login's password too
        if _URI_START.match(conn_id) and urlsplit(conn_id).password is not None:
            return True
    except ValueError:  # a malformed host ("[" unclosed): the text's own reading below
        pass
    return _SECRET.search(conn_id) is not None


@dataclass(frozen=True)
class Origin:
    """Where a document came from: its file (or a label) and its YAML node tree, to give line numbers."""

    name: str = "<topology>"
    node: yaml.Node | None = None

    def line(self, path: Iterable[str | int]) -> int | None:
        """1-based line of the value (or key, for the last step of ``path``) at ``path``."""
        node, line = self.node, None
        for step in path:
            if isinstance(node, yaml.MappingNode):
                found = next(((k, v) for k, v in node.value if k.value == step), None)
                if found is None:
                    break
                line, node = found[0].start_mark.line + 1, found[1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
                node = node.value[step]
                line = node.start_mark.line + 1
            else:
                break
        if line is None and self.node is not None:
            line = self.node.start_mark.line + 1
        return line

    def error(self, path: Iterable[str | int], message: str) -> ConfigurationError:
        steps = list(path)
        line = self.line(steps)
        where = f"{self.name}:{line}" if line else self.name
        return ConfigurationError(f"{where}: {_key(steps) or '(document)'}: {message}")


def _key(path: Iterable[str | int]) -> str:
    out = ""
    for step in path:
        if isinstance(step, int) or not re.fullmatch(r"[A-Za-z0-9_-]+", str(step)):
            out += f"[{step!r}]"  # an index, or a key that would not read as one (spaces, newlines)
        else:
            out += f".{step}" if out else str(step)
    return out


# A topology is a few kilobytes (a site or replication is a line or two): bounds that no real one
# reaches, so a hostile or mistaken file (a log, an alias bomb) is refused fast and in little memory.
MAX_DOCUMENT_BYTES = 1 << 20
MAX_DOCUMENT_VALUES = 100_000


def parse(text: str, name: str) -> tuple[Any, Origin]:
    """The document in ``text`` (YAML or JSON) and its origin; a syntax error names file and line.
    Only plain YAML is read (``safe_load``: no tags that build objects); a key given twice, a
    document nested too deeply or expanding (through aliases) to more than ``MAX_DOCUMENT_VALUES``
    values is refused."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        _check_values(node, name)
        doc = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        context = f" ({exc.context} from line {exc.context_mark.line + 1})" if exc.context and exc.context_mark else ""
        raise ConfigurationError(f"{name}{line}: YAML syntax error: {exc.problem}{context}") from None
    except yaml.YAMLError as exc:
        raise ConfigurationError(f"{name}: YAML syntax error: {one_line(exc)}") from None
    except RecursionError:
        raise ConfigurationError(f"{name}: nested too deeply for a topology") from None
    return doc, Origin(name, node)


def _check_values(root: yaml.Node | None, name: str) -> None:
    """Refuse a key given twice in one mapping (YAML would keep the last silently) and a document of
    more than ``MAX_DOCUMENT_VALUES`` values, counting each alias as what it expands to."""
    stack, seen = [root] if root is not None else [], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_DOCUMENT_VALUES:
            raise ConfigurationError(
                f"{name}: more than {MAX_DOCUMENT_VALUES} values (YAML aliases expanding?); a topology is far smaller"
            )
        if isinstance(node, yaml.MappingNode):
            keys: set[str] = set()
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    if key.value in keys:
                        raise ConfigurationError(
                            f"{name}:{key.start_mark.line + 1}: key {key.value!r} given twice in one mapping"
                        )
                    keys.add(key.value)
                stack += (key, value)
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def read(path: Path) -> tuple[Any, Origin]:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise ConfigurationError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise ConfigurationError(f"{path}: larger than {MAX_DOCUMENT_BYTES} bytes; a topology is a few kilobytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigurationError(f"{path}: not a text file (UTF-8 YAML expected)") from None
    return parse(text, str(path))


def validate(doc: Any, origin: Origin | None = None) -> None:
    """Refuse a document that does not follow ``SCHEMA`` (the first error, one line)."""
    origin = origin or Origin()
    if not isinstance(doc, dict):  # an empty file said "None is not of type 'object'"
        kind = {list: "a list", str: "a string", bool: "a boolean"}.get(type(doc), "a number")
        what = "the file is empty" if doc is None else f"{kind}, not a mapping"
        raise origin.error([], f"{what}: a topology is a mapping of sites:, replication: (docs/topology.md)")
    for path, number in _non_finite(doc, []):
        raise origin.error(path, f"{number} is not a finite number")
    errors = sorted(
        _validator().iter_errors(doc), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path)))
    )
    if errors:
        raise _explain(errors[0], origin)
    for index, site in enumerate(doc["sites"]):
        if "conn_id" in site and holds_password(site["conn_id"]):
            raise origin.error(
                ["sites", index, "conn_id"],
                "holds a password; name an Airflow connection or an "
                "entry of the connections file instead (the topology is stored on every site)",
            )


def _non_finite(value: Any, path: list[str | int]) -> Iterator[tuple[list[str | int], float]]:
    """The NaNs and infinities in a document (YAML's ``.nan``, JSON's ``NaN``): a NaN passes every
    bound of the schema (no comparison holds), so ``validate`` said valid and the site's ``json``
    refused the document at ``lr topology apply``."""
    if isinstance(value, float) and not math.isfinite(value):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, [*path, key])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _non_finite(item, [*path, index])


def _explain(error: ValidationError, origin: Origin) -> ConfigurationError:
    path = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = sorted(error.schema.get("properties", {}))
        extra = sorted(str(k) for k in error.instance if k not in known)
        hint = f" (known: {', '.join(known)})" if known else ""
        return origin.error(path + extra[:1], f"unknown key {extra[0]!r}{hint}")
    if error.validator == "pattern":
        if path[:1] == ["providers"]:
            return origin.error(path, f"{error.instance!r} is not a valid provider: expected 'package.module:function'")
        if path[-1:] in (["region"], ["conn_id"]):
            return origin.error(path, f"{error.instance!r} is not one line of text: {TEXT_RULES}")
        if "clients" in path:
            return origin.error(path, f"{error.instance!r} is not a valid client name: expected {_CLIENT_RULES}")
        return origin.error(path, f"{error.instance!r} is not a valid site id: expected {SITE_RULES}")
    if error.validator == "maxItems":  # the message jsonschema makes quotes the whole list
        return origin.error(path, f"{len(error.instance)} items; at most {error.validator_value}")
    if error.validator == "propertyNames":
        return origin.error(
            path + [str(error.instance)], f"{error.instance!r} is not a valid client name: expected {_CLIENT_RULES}"
        )
    return origin.error(path, error.message)


TEXT_RULES = "no newline, tab or other control character (a region: 1-63 characters)"
_CLIENT_RULES = "1-63 letters, digits, '-' or '_', starting with a letter or digit"
SITE_RULES = "1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit"
