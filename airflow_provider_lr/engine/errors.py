"""Errors lr raises on purpose. Each message names the site, session or input and the fix."""

from __future__ import annotations

import re
import time
from collections.abc import Callable


class LRError(Exception):
    """Base of every error lr raises on purpose."""


class ConfigurationError(LRError):
    """A site, connection, topology or argument is missing or invalid."""


class InputError(ConfigurationError):
    """The user's input refused before anything is done (a name or count a command cannot take):
    the CLI exits 2 on it, as on any other usage error."""


class TopologyMismatchError(ConfigurationError):
    """The topology file in hand is not the one the sites run (a stale file after a failover, an
    edited one not applied): nothing is done from it."""


class SiteUnreachableError(LRError):
    """A site's server cannot be reached now (down, restarting, refusing or out of connections):
    nothing was done; whoever waits on the site retries, unlike a ``ConfigurationError``."""


class SchemaError(LRError):
    """A site's lr schema cannot be installed or upgraded as asked."""


class TransmitError(LRError):
    """A transmit call was refused; nothing was written."""


class FencedError(LRError):
    """A replicator whose session lease was taken over tried to write; nothing was written."""

    def __init__(self, message: str, sink_epoch: int | None = None) -> None:
        super().__init__(message)
        self.sink_epoch = sink_epoch  # the epoch the sink has seen, when a sink refused


class StaleBatchError(LRError):
    """A batch does not fit the sink's state (gap, other snapshot, other sync); renegotiate."""


class FullSyncError(LRError):
    """A provider failed while supplying a full sync; the request stays pending."""


class MalformedEntryError(LRError, ValueError):
    """A receive-queue entry that cannot be delivered; it was moved to lr.receive_dead_letters.
    (A ``ValueError`` too, as it was before it joined this taxonomy.)"""


class TrimmedError(LRError):
    """Entries a reader needs were trimmed from the source's log (CorfuDB's TrimmedException):
    nothing was delivered; the session renegotiates, which sends it to a snapshot sync."""

    def __init__(self, message: str, after: int, trim_mark: int) -> None:
        super().__init__(message)
        self.after = after
        self.trim_mark = trim_mark


class TableError(LRError):
    """A federated table cannot be opened or replicated as asked (no primary key, not found)."""


class ApplyError(TableError):
    """The sink refused a batch of table changes (a constraint, trigger or privilege of the sink's
    table the source does not have): nothing of the batch was applied; the session retries it."""


class SchemaMismatchError(TableError):
    """A federated table differs between source and sink (a missing column, another type or key):
    the session stops before writing anything of it and ``lr status`` says why."""


class DeliveryTimeout(LRError, TimeoutError):
    """A wait for delivery (``wait_until_safe`` / ``wait_until_ready``) ran out of time: names the
    destinations that have not acknowledged. Nothing is lost: the entries stay in the log and are
    delivered when the sinks come back; waiting again is safe."""

    def __init__(self, message: str, position: int | None, missing: list[str], regions: list[str]) -> None:
        super().__init__(message)
        self.position = position
        self.missing = missing
        self.regions = regions


def require_counts(**counts: object) -> None:
    """Refuse a count given but not a whole number of at least 1 (chunks, tasks, entries, rows per
    batch): a zero or negative one would otherwise mean "everything", "nothing" or a crash later.
    ``None`` means "the default" and passes."""
    for name, value in counts.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigurationError(f"{name} must be a whole number of at least 1, not {value!r}")


MAX_SECONDS = 10 * 365 * 86400.0  # a bound in seconds beyond this is a mistake (PostgreSQL's intervals end too)


def require_seconds(**seconds: object) -> None:
    """Refuse a bound in seconds given but not a number above 0 and at most ``MAX_SECONDS`` (``None``:
    the default): NaN, infinity or 1e300 failed later, in the server's words ("interval out of range")."""
    for name, value in seconds.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS
        ):
            raise ConfigurationError(
                f"{name} must be a number of seconds above 0 and at most {MAX_SECONDS:.0f}, not {value!r}"
            )


def require_site_ids(name: str, value: object) -> list[str]:
    """``value`` as a list of site ids, refused when it is not one: a bare string would otherwise be
    read letter by letter (a demand or a wait that names no real site, and never ends or delivers)."""
    if isinstance(value, (str, bytes)):
        raise ConfigurationError(f"{name} is a list of site ids, not one string: give [{value!r}]")
    named = list(value)  # type: ignore[call-overload]  # any iterable; anything else fails here
    if not all(isinstance(s, str) and s for s in named):
        raise ConfigurationError(f"{name} must be site ids (strings), not {named!r}")
    return named


# A password in what an error may quote: a DSN's ``password=...`` (or ``sslpassword``, or the
# environment's ``PGPASSWORD=``), a URI's ``user:...@`` (a user holding an unescaped ``@`` too, as
# ``user@server`` logins are written), a connection's JSON or Python form. Masked as
# ``***`` wherever lr prints or stores an error. An unquoted DSN value runs to the next blank, as
# libpq reads it (quotes inside it, a backslash-escaped blank); a quoted one (single quotes, as libpq
# quotes; double quotes, as a user may write it) to its closing quote, escaped quotes and blanks
# inside; a URI's password to its last ``@`` (an unescaped ``@`` or ``/`` in it is a mistake users
# make: libpq then reads a host and port, and the message that refuses it quoted the URI whole), or,
# holding blanks (unescaped too), to the ``@`` after them.
_DSN_PASSWORD = re.compile(
    r"""(?i)((?:\b|(?<=pg))(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|"(?:[^"\\]|\\.)*"?|(?:\\.|[^\s\\])+)"""
)
_SECRETS = (
    # (blanks first: ``u:p@ss w@h`` masked only ``p``; a chunk holding ``/`` ends the URI's authority)
    (
        re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:]*:)(?:[^\s/]*(?:[ \t][^\s@]+)+|\S*)@"),
        r"\1***@",
    ),
    (re.compile(r"""(?i)(["'](?:ssl)?password["']\s*:\s*)("(?:[^"\\]|\\.)*"?|'(?:[^'\\]|\\.)*'?)"""), r"\1'***'"),
    # libpq's refusal of a DSN whose value holds a blank (``password=my secret``) names the word after
    # it, the password's tail: masked, whatever the word (the DSN itself is not in the message)
    (re.compile(r'(missing "=" after ")[^"]*(")'), r"\1***\2"),
    # libpq reading a URI itself (a ``dbname`` holding one) takes a password's unescaped ``@`` as the
    # end of the user part: the rest of the password is then the host (or port) it names. No host or
    # port holds an ``@``: what comes before the last one is masked.
    (re.compile(r'((?:host name|integer value|server at|network address) ")[^"]*@'), r"\1***@"),
)
_CLOSERS = {")": "(", "]": "[", "}": "{"}


def _masked_dsn_value(found: re.Match[str]) -> str:
    """``password=***`` for a DSN's value. An unquoted value runs to the next blank, so it took the
    closing parenthesis, bracket or quote of the text around the DSN (``(host=h password=x)`` was
    shown ``(host=h password=***``): those that close one the text opened before the DSN are kept
    after the mask (with the punctuation after them). A password ending so inside such a text is
    ambiguous; only the characters the text needs to close are kept, never one of the password's
    others."""
    return _masked_value(found.group(1), found.group(2), found.string[: found.start()])


def _masked_value(prefix: str, value: str, before: str) -> str:
    """``prefix`` and the mask of ``value``, which ``before`` (the text up to ``prefix``) precedes."""
    kept = ""
    if value[:1] in ("'", '"'):
        return f"{prefix}***"
    opened = {o: max(0, before.count(o) - before.count(c)) for c, o in _CLOSERS.items()}
    quotes = {q: before.count(q) % 2 for q in ("'", '"')}
    tail = re.search(r"[.,;:!?]*$", value)
    punctuation = tail.group() if tail else ""
    rest = value[: len(value) - len(punctuation)]
    while rest:
        last = rest[-1]
        if last in _CLOSERS and opened[_CLOSERS[last]]:
            opened[_CLOSERS[last]] -= 1
        elif last in quotes and quotes[last]:
            quotes[last] = 0
        else:
            break
        kept, rest = last + kept, rest[:-1]
    if not kept:  # nothing the text closes: the punctuation may be the password's
        return f"{prefix}***"
    return f"{prefix}***{kept}{punctuation}"


# A URI's query parameter whose name libpq (and lr's ``conninfo.from_uri``) reads percent-decoded:
# ``?pass%77ord=...`` is a password to both, and its value showed whole in every message quoting the
# URI (``unknown site '...'``, argparse's ``unrecognized arguments``). Its value runs to the next
# ``&``, ``#`` or blank, as libpq splits the query.
_URI_PARAM = re.compile(
    r"([?&]((?:[^=&#\s%]|%[0-9A-Fa-f]{2})*%[0-9A-Fa-f]{2}(?:[^=&#\s%]|%[0-9A-Fa-f]{2})*)=)([^&#\s]*)"
)
_SECRET_NAMES = ("password", "sslpassword")


def _masked_uri_param(found: re.Match[str]) -> str:
    """A percent-encoded parameter name's value masked when the name decodes to a password's (the
    parenthesis or quote closing the text around it kept, as ``_masked_dsn_value`` keeps them)."""
    name = re.sub(r"%([0-9A-Fa-f]{2})", lambda h: chr(int(h.group(1), 16)), found.group(2))
    if name.lower() not in _SECRET_NAMES:
        return found.group()
    return _masked_value(found.group(1), found.group(3), found.string[: found.start()])


def mask_secrets(text: str) -> str:
    """``text`` with every password it quotes replaced by ``***``."""
    if "%" in text:
        text = _URI_PARAM.sub(_masked_uri_param, text)
    text = _DSN_PASSWORD.sub(_masked_dsn_value, text)
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


def _escaped(control: re.Match[str]) -> str:
    """A control character as ``one_line`` shows it: a tab as a space, others as ``\\x1b``/``\\u202e``."""
    code = ord(control.group())
    return " " if code == 9 else f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def one_line(exc: BaseException | str) -> str:
    """An error as one line, for logs, status and the CLI: psycopg's messages carry newlines (DETAIL,
    HINT, CONTEXT) that break "one line per error"; they are joined with ' | ' instead. A password
    the text quotes is masked (``mask_secrets``). Other control characters are shown escaped
    (``\\x1b``; a tab as a space): a server's DETAIL quotes the application's values (``Key
    (email)=(...) already exists``), and an ESC among them reached the operator's terminal raw
    through ``lr status`` and ``lr sync``'s log (an escape sequence can rewrite what it shows)."""
    text = exc if isinstance(exc, str) else (str(exc) or type(exc).__name__)
    line = " | ".join(part.strip() for part in text.splitlines() if part.strip())
    if _CONTROL.search(line):
        line = _CONTROL.sub(_escaped, line)
    return mask_secrets(line)


# What breaks a printed line or hides in it: the C0 controls (newline among them) and DEL, the C1
# controls (U+009B is a terminal's CSI, as ESC [ is; U+0085 a newline), the Unicode line and
# paragraph separators (``str.splitlines`` splits there) and the bidirectional embeddings,
# overrides and isolates (after U+202E a line reads backwards). A character class, so that the
# forms' patterns (``topology_schema``) say the same in Python and in the browser.
CONTROL_CHARS = r"\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[{CONTROL_CHARS}]")


def is_control(char: str) -> bool:
    """A character that breaks a printed line or hides in it (``CONTROL_CHARS``): a name or a
    reason lr prints may hold none. Only the C0 controls and DEL were: a reason with U+009B (CSI)
    or U+202E was recorded and printed raw."""
    return _CONTROL.match(char) is not None


def without_statement(line: str) -> str:
    """A ``one_line`` error without psycopg's LINE and caret parts: the statement's text, which may
    hold values, and says nothing to whoever reads the error."""
    return " | ".join(p for p in line.split(" | ") if not p.startswith("LINE ") and p != "^")


def error_line(exc: BaseException) -> str:
    """``one_line`` with the exception's type in front (``OperationalError: ...``): what a session's
    report, ``last_error`` and a stream's hand-back carry."""
    return one_line(f"{type(exc).__name__}: {exc}")


class RepeatedErrors:
    """Say an error once: the same error of the same subject (a session, a site) again only as
    "still failing (N times)", at most every ``every`` seconds, so a sink that is down for a minute
    is not reported a hundred times; another error, or the next one after a success, is said at
    once."""

    def __init__(self, every: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self._seen: dict[str, tuple[str, int, float]] = {}  # subject -> (error, times, when last said)

    def due(self, subject: str, error: str) -> int | None:
        """This failure of ``subject`` is its Nth in a row with the same error: N when it is to be
        said now (1: in full; more: ``still_failing``), None to keep quiet."""
        error = one_line(error)
        last = self._seen.get(subject)
        now = self.clock()
        if last is None or last[0] != error:
            self._seen[subject] = (error, 1, now)
            return 1
        times = last[1] + 1
        due = now - last[2] >= self.every
        self._seen[subject] = (error, times, now if due else last[2])
        return times if due else None

    def cleared(self, subject: str) -> bool:
        """``subject`` succeeded: True when it was failing (its next failure is said in full)."""
        return self._seen.pop(subject, None) is not None


def still_failing(times: int, error: str) -> str:
    """How a failure said before is said again (``RepeatedErrors``)."""
    return f"still failing ({times} times): {one_line(error)}"


SHOWN_CHARS = 80  # of a name a message quotes back


def shown(value: object) -> str:
    """A value the user gave, quoted back in a message (``repr``), cut to ``SHOWN_CHARS`` with its
    length said: a 100,000-character site or client name came back whole in every refusal of it."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return text[: SHOWN_CHARS - 1] + "…" + size


SHOWN_VALUES = 10  # of a list a message quotes back


def shown_all(values: list) -> str:
    """Values the user gave, each ``shown``, the first ``SHOWN_VALUES`` of them and how many more:
    100,000 unknown destinations came back whole (a message of a megabyte)."""
    more = f" and {len(values) - SHOWN_VALUES} more" if len(values) > SHOWN_VALUES else ""
    return ", ".join(map(shown, values[:SHOWN_VALUES])) + more


def listing(items: object, at_most: int | None = None) -> str:
    """Names or figures for a message, without Python's brackets and quotes: ``site-a, site-b``,
    ``policy 85, audit 3`` (a mapping); ``none`` when empty. ``at_most``: the first so many and how
    many more (names the user gave, which may be many)."""
    if isinstance(items, dict):
        parts = [f"{k} {v}" for k, v in items.items()]
    elif isinstance(items, (str, bytes)):
        parts = [str(items)]
    else:
        parts = [str(i) for i in items]  # type: ignore[attr-defined]
    if at_most is not None and len(parts) > at_most:
        parts = parts[:at_most] + [f"and {len(parts) - at_most} more"]
    return ", ".join(parts) or "none"
