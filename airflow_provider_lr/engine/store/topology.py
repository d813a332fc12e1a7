"""The topology: which sites exist, in which region, and who replicates to whom for which clients;
and the one owner of ``lr.topology``, the copy of it applied to a site.

It is a YAML document (``include/topology.yaml`` by default); its ``topology_config_id`` is a hash
of its normalized content, so any change yields a new id and negotiation can refuse to proceed
across different ids. ``engine/site/topology.py`` records it on sites (``apply_to_site``), which is
what the transmit path validates destinations against; every read of what a site holds is here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg2.extensions
import yaml

from airflow_provider_lr.engine.db.conninfo import ConnInfo, resolve
from airflow_provider_lr.engine.db.durability import check_rule
from airflow_provider_lr.engine.db.timeouts import Timeouts
from airflow_provider_lr.engine.db.topology_schema import Origin, read, validate
from airflow_provider_lr.engine.errors import ConfigurationError, LRError, listing, shown
from airflow_provider_lr.engine.vocabulary import SessionKey, receive_queue_name
from airflow_provider_lr.paths import include_dir, lr_home, write_replacing

TOPOLOGY_ENV = "LR_TOPOLOGY"


@dataclass(frozen=True)
class SiteSpec:
    site_id: str
    region: str = "default"
    conn_id: str | None = None


@dataclass(frozen=True)
class Replication:
    source: str
    sinks: tuple[str, ...]
    clients: tuple[str, ...]


@dataclass(frozen=True)
class Topology:
    sites: dict[str, SiteSpec]
    replications: tuple[Replication, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    # client name -> full-sync provider as "package.module:function"
    providers: dict[str, str] = field(default_factory=dict)
    # DistributedLog's rule: min_regions_for_durability, ack_quorum, write_quorum (engine/db/durability.py)
    durability: dict[str, int] = field(default_factory=dict)
    # the file it was read from (``load``): named by every error about it; not part of its id
    path: str | None = field(default=None, compare=False)

    def sessions(
        self, source: str | None = None, sink: str | None = None, client: str | None = None
    ) -> list[SessionKey]:
        """Every session the topology defines (optionally only those of one source, sink or
        client), sorted."""
        found = {
            SessionKey(r.source, s, c)
            for r in self.replications
            for s in r.sinks
            for c in r.clients
            if (source is None or r.source == source)
            and (sink is None or s == sink)
            and (client is None or c == client)
        }
        return sorted(found)

    @property
    def timeouts(self) -> Timeouts:
        """The bounds on every connection lr opens to this topology's sites (``settings:``)."""
        return Timeouts.from_settings(self.settings)

    def select(self, source: str | None = None, sink: str | None = None, client: str | None = None) -> list[SessionKey]:
        """``sessions`` for a user's choice (``lr full-sync``, the lr_full_sync form): none chosen
        is every session; a choice that matches nothing is refused, naming the sessions there are."""
        found = self.sessions(source, sink, client)
        if not found:
            chosen = " ".join(
                f"{what} {name!r}" for what, name in (("from", source), ("to", sink), ("for client", client)) if name
            )
            raise ConfigurationError(
                f"no session replicates {chosen or 'anything'} in topology "
                f"{self.path or self.topology_config_id}; its sessions are "
                f"{[str(k) for k in self.sessions()]}"
            )
        return found

    def setting(self, name: str, default: Any) -> Any:
        return type(default)(self.settings.get(name, default))

    @property
    def document(self) -> dict[str, Any]:
        return {
            "sites": [
                {"id": s.site_id, "region": s.region, **({"conn_id": s.conn_id} if s.conn_id else {})}
                for s in sorted(self.sites.values(), key=lambda s: s.site_id)
            ],
            "replication": [
                {"source": r.source, "sinks": list(r.sinks), "clients": list(r.clients)} for r in self.replications
            ],
            "settings": self.settings,
            **({"providers": dict(sorted(self.providers.items()))} if self.providers else {}),
            **({"durability": dict(sorted(self.durability.items()))} if self.durability else {}),
        }

    @property
    def topology_config_id(self) -> str:
        canonical = json.dumps(self.document, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def conn_id(self, site_id: str) -> str:
        """The connection that reaches a site: its ``conn_id`` (an Airflow connection, an entry of the
        connections file), or without one the site id itself."""
        return self.site(site_id).conn_id or site_id

    def site(self, site_id: str) -> SiteSpec:
        try:
            return self.sites[site_id]
        except KeyError:
            raise ConfigurationError(
                f"unknown site {shown(site_id)}; the topology knows {listing(sorted(self.sites))}"
            ) from None


def from_document(doc: Any, origin: Origin | None = None) -> Topology:
    """Validate and build a topology from its YAML/JSON document (``topology_schema``); errors
    name the file, line and key when ``origin`` says where the document came from."""
    origin = origin or Origin()
    validate(doc, origin)
    sites: dict[str, SiteSpec] = {}
    for index, raw in enumerate(doc["sites"]):
        site_id = raw["id"]
        if site_id in sites:
            raise origin.error(["sites", index, "id"], f"site {site_id!r} appears twice")
        sites[site_id] = SiteSpec(site_id, raw.get("region", "default"), raw.get("conn_id"))
    replications = []
    for index, raw in enumerate(doc.get("replication") or []):
        source, sinks = raw["source"], tuple(raw["sinks"])
        for key, name in [("source", source), *(("sinks", sink) for sink in sinks)]:
            if name not in sites:
                raise origin.error(
                    ["replication", index, key], f"unknown site {name!r}; known: {listing(sorted(sites))}"
                )
        if source in sinks:
            raise origin.error(["replication", index, "sinks"], f"site {source!r} cannot replicate to itself")
        replications.append(Replication(source, sinks, tuple(raw["clients"])))
    _refuse_shared_connections(sites, origin)
    _refuse_case_twin_clients(doc, origin)
    _refuse_ambiguous_queue_names(replications, origin)
    durability = dict(doc.get("durability") or {})
    if durability:
        _refuse_unsound_durability(durability, sites, replications, origin)
    return Topology(
        sites, tuple(replications), dict(doc.get("settings") or {}), dict(doc.get("providers") or {}), durability
    )


def _refuse_unsound_durability(
    rule: dict[str, int], sites: dict[str, SiteSpec], replications: list[Replication], origin: Origin
) -> None:
    """Each source with its sinks must be able to meet ``durability`` and never meet its ack
    quorum in fewer regions than it asks (``durability.check_rule``)."""
    sinks_of: dict[str, set[str]] = {}
    for r in replications:
        sinks_of.setdefault(r.source, set()).update(r.sinks)
    for source, sinks in sorted(sinks_of.items()):
        regions = {site: sites[site].region for site in {source, *sinks}}
        problem = check_rule(
            regions, rule["min_regions_for_durability"], rule.get("ack_quorum"), rule.get("write_quorum")
        )
        if problem is not None:
            raise origin.error(
                ["durability", problem.key], f"source {source!r} and its {len(sinks)} sinks: {problem.message}"
            )


def _refuse_shared_connections(sites: dict[str, SiteSpec], origin: Origin) -> None:
    """Two sites must not reach one database through one connection: Airflow (and ``resolve``) read
    a connection id from ``AIRFLOW_CONN_<ID upper-cased>``, so ids equal but for case (``lr_a``,
    ``LR_A``) are one connection there; the two sites would share one lr schema, silently."""
    seen: dict[str, str] = {}
    for index, spec in enumerate(sites.values()):
        conn_id = spec.conn_id or spec.site_id
        is_dsn = "=" in conn_id or "://" in conn_id  # a DSN is read as written
        other = seen.setdefault(conn_id if is_dsn else conn_id.upper(), spec.site_id)
        if other != spec.site_id:
            theirs = sites[other].conn_id or other
            named = f"one connection {conn_id!r}" if theirs == conn_id else f"connections {theirs!r} and {conn_id!r}"
            env = "" if is_dsn else f" (Airflow reads it from AIRFLOW_CONN_{conn_id.upper()})"
            raise origin.error(
                ["sites", index, "conn_id" if spec.conn_id else "id"],
                f"sites {other!r} and {spec.site_id!r} name {named}, one database{env}: "
                "give each site a connection of its own",
            )


def _refuse_case_twin_clients(doc: Mapping[str, Any], origin: Origin) -> None:
    """Client names are case-sensitive in lr (``policy`` and ``Policy`` would be two clients, two
    receive queues), where a PostgreSQL user expects an unquoted name folded to lower case: two names
    equal but for case are refused as the likely typo they are, naming both."""
    seen: dict[str, str] = {}
    named: list[tuple[list[str | int], str]] = [
        (["replication", i, "clients"], c) for i, r in enumerate(doc.get("replication") or []) for c in r["clients"]
    ]
    named += [(["providers", c], c) for c in doc.get("providers") or {}]
    for path, client in named:
        other = seen.setdefault(client.lower(), client)
        if other != client:
            raise origin.error(
                path,
                f"clients {other!r} and {client!r} differ only in case; client names are case-sensitive, "
                "so these would be two clients with two queues: use one spelling",
            )


def _refuse_ambiguous_queue_names(replications: list[Replication], origin: Origin) -> None:
    """Receive queues are named ``LRQ_Recv_<client>_<source>``; with '_' allowed in both names two
    sessions into one sink could get the same queue name (client ``a_b`` from ``c`` and client
    ``a`` from ``b_c``) and their data would be mixed up. Such topologies are refused."""
    seen: dict[tuple[str, str], tuple[str, str]] = {}
    for index, r in enumerate(replications):
        for sink in r.sinks:
            for client in r.clients:
                name = (sink, receive_queue_name(client, r.source))
                other = seen.setdefault(name, (client, r.source))
                if other != (client, r.source):
                    raise origin.error(
                        ["replication", index, "clients"],
                        f"sink {sink!r} would get one receive queue {name[1]!r} for client {client!r} from "
                        f"{r.source!r} and for client {other[0]!r} from {other[1]!r}; rename one (avoid '_' in "
                        "client or site names)",
                    )


def default_path() -> Path:
    return Path(os.environ.get(TOPOLOGY_ENV) or include_dir() / "topology.yaml")


def load(path: Path | str | None = None) -> Topology:
    path = Path(path) if path else default_path()
    if path.is_dir():
        raise ConfigurationError(f"topology file {path} is a directory (set {TOPOLOGY_ENV} or pass a file)")
    if not path.is_file():
        raise ConfigurationError(f"topology file {path} not found (set {TOPOLOGY_ENV} or pass a path)")
    return replace(from_document(*read(path)), path=str(path))


def reread(topology: Topology) -> Topology:
    """The topology's file as it is now (a long-running replicator's copy may predate an edit that
    was applied since); the topology itself when it has no file or the file cannot be read."""
    if not topology.path:
        return topology
    try:
        return load(topology.path)
    except LRError:
        return topology


# --- lr.topology: the topology applied to a site (one row, or none before the first apply) --------
def config_id(cur: psycopg2.extensions.cursor) -> str | None:
    """The id of the topology applied to the site (None: none applied), in the caller's transaction."""
    cur.execute("SELECT topology_config_id FROM lr.topology")
    row = cur.fetchone()
    return row[0] if row else None


def recorded_id(conn: psycopg2.extensions.connection) -> str | None:
    """The id of the topology last applied to a site (None: none applied). Commits."""
    with conn.cursor() as cur:
        found = config_id(cur)
    conn.commit()
    return found


def applied_max_payload_bytes(cur: psycopg2.extensions.cursor) -> int | None:
    """The applied topology's ``settings: max_payload_bytes`` (None: not set, or none applied), in
    the caller's transaction (an application's, for the log writer)."""
    cur.execute(
        "SELECT (document OPERATOR(pg_catalog.#>>) '{settings,max_payload_bytes}')::pg_catalog.int8 FROM lr.topology"
    )
    row = cur.fetchone()
    return row[0] if row else None


def applied_durability(conn: psycopg2.extensions.connection) -> dict[str, int] | None:
    """The applied topology's ``durability`` rule (None: no rule, or none applied). Commits."""
    with conn.cursor() as cur:
        cur.execute("SELECT document -> 'durability' FROM lr.topology")
        row = cur.fetchone()
    conn.commit()
    return row[0] if row and row[0] else None


def record(cur: psycopg2.extensions.cursor, topology: Topology) -> None:
    """Write ``topology`` as the one applied to the site, in the caller's transaction."""
    cur.execute(
        "INSERT INTO lr.topology (topology_config_id, document) VALUES (%s, %s) "
        "ON CONFLICT (singleton) DO UPDATE SET topology_config_id = EXCLUDED.topology_config_id, "
        "document = EXCLUDED.document, applied_at = now()",
        (topology.topology_config_id, json.dumps(topology.document)),
    )


def applied_document(cur: psycopg2.extensions.cursor) -> dict | None:
    """The document of the topology applied to the site (None: none applied), in the caller's transaction."""
    cur.execute("SELECT document FROM lr.topology")
    row = cur.fetchone()
    return row[0] if row else None


def from_site(conn: psycopg2.extensions.connection) -> Topology:
    """The topology last applied to a site: what its sessions run under (and what negotiation
    compares), readable without the YAML file."""
    with conn.cursor() as cur:
        document = applied_document(cur)
    conn.commit()
    if document is None:
        raise ConfigurationError("no topology has been applied to this site (run `lr topology apply`)")
    return from_document(document, Origin("the topology stored on the site"))


def failover_files(topology_config_id: str, beside: str | Path | None = None) -> list[Path]:
    """Where a failover writes the topology it applied: ``$LR_HOME/topology-<id>.yaml`` (``lr
    failover``), or beside the topology file the lr_failover task read (a worker's ``$LR_HOME`` is
    nobody's to look in); a stale file's message looks in both, so it can name the file to use."""
    name = f"topology-{topology_config_id}.yaml"
    found = [(lr_home() / name).resolve(), *([Path(beside).resolve().parent / name] if beside else [])]
    return list(dict.fromkeys(found))  # the demo's file is in $LR_HOME: one path, said once


def write_document(topology: Topology, path: str | Path) -> Path:
    """Write ``topology``'s document as a topology file (a failover's new one), making its directory.
    Its name is known in advance (``failover_files``): written to a new file and moved into place
    (``write_replacing``), a link planted there is replaced, never written through. Mode 0644, as
    before (a topology holds no password: the loader refuses one)."""
    return write_replacing(path, yaml.safe_dump(topology.document, sort_keys=False))


def unwritable(path: str | Path) -> str | None:
    """Why ``write_document`` could not write ``path`` (it is a directory, or a file stands where a
    directory of its path would be), or None: asked before a failover, which writes it last."""
    out = Path(path)
    if out.is_dir():
        return "it is a directory"
    for parent in out.parents:
        if parent.exists():
            return None if parent.is_dir() else f"{parent} is not a directory"
    return None


def site_conninfo(topology: Topology, site_id: str) -> ConnInfo:
    """How to reach a site of the topology (see ``Topology.conn_id``), with the topology's bounds
    on its connections (keepalives, timeouts: ``timeouts.py``)."""
    return resolve(topology.conn_id(site_id)).with_timeouts(topology.timeouts)


@dataclass(frozen=True)
class TopologyDrift:
    """The topology in hand (a file) is not the one some sites run: ``held`` maps each such site
    to the id it holds. Every command and task that works from a file refuses (or, ``lr status``,
    flags) it, so a stale file is named as such rather than as a lease or negotiation problem."""

    topology: Topology
    held: dict[str, str | None]
    # a site whose clients a failover moved (as its sinks say) -> where they went: it rejoins instead
    failed_over: dict[str, str] = field(default_factory=dict)

    def message(self) -> str:
        by_id: dict[str | None, list[str]] = {}
        for site, held in sorted(self.held.items()):
            by_id.setdefault(held, []).append(site)
        holds = ", ".join(f"{held or '(none applied)'} ({', '.join(sites)})" for held, sites in by_id.items())
        name = self.topology.path or "in use"
        written = [str(p) for held in by_id if held for p in failover_files(held, self.topology.path) if p.is_file()]
        mine = self.topology.topology_config_id
        # the file still replicates from a failed-over site to the site its clients went to: it is
        # older than that failover (applying it is refused; the new source does not run it, or, in
        # the middle of a planned switchover, the drained old source runs the new one already)
        predates = sorted(
            (site, to)
            for site, to in self.failed_over.items()
            if (to in self.held or site in self.held) and self.topology.sessions(site, to)
        )
        # behind the site its clients went to (a planned switchover already applied it there); not
        # with a file older than the failover, which names neither its topology nor the rejoin's
        rejoin = [
            (site, to)
            for site, to in sorted(self.failed_over.items())
            if site in self.held and self.held[site] != self.held.get(to, mine) and (site, to) not in predates
        ]
        if predates:
            advice = (
                f": it predates the failover of {', '.join(f'{site} to {to}' for site, to in predates)}: point "
                f"--topology (Airflow: the Variable lr_topology or ${TOPOLOGY_ENV}) at the topology the failover wrote "
                "(`lr failover`, or the lr_failover DAG beside the file its task read)"
            )
        elif set(self.held) <= {site for site, _ in rejoin}:
            advice = ""  # only old sources to rejoin: an apply is the wrong step (and refused)
        elif written:  # the sites run a topology a failover wrote: that file is the one to use
            advice = f": point --topology (Airflow: the Variable lr_topology or ${TOPOLOGY_ENV}) at {written[0]}"
            written = []
        else:
            advice = (
                f": apply the current file with `lr topology apply --topology {name}` or point --topology (Airflow: "
                f"the Variable lr_topology or ${TOPOLOGY_ENV}) at the file in use"
            )
        return (
            f"topology file {name} has id {mine}; sites hold {holds}{advice}"
            + (f" (the failover wrote {', '.join(written)})" if written else "")
            + "".join(
                f"; site {site} was failed over (its clients now come from {to}): rejoin it with `lr failover "
                f"--topology {name} --rejoin {site}`, not a topology apply (the rejoin counts what it committed "
                "after the cut, refuses its writers and hands its federated tables over)"
                for site, to in rejoin
            )
        )


def drift(
    topology: Topology,
    recorded: Mapping[str, str | None],
    also: Collection[str] = (),
    failed_over: Mapping[str, str] | None = None,
) -> TopologyDrift | None:
    """The sites of ``recorded`` (site -> id it holds) that run another topology than ``topology``
    (or one of the ids ``also`` accepts); None when every one runs it. ``failed_over``: the old
    sources of failovers (-> the new source) as their sinks say, to name the rejoin of one behind."""
    accepted = {topology.topology_config_id, *also}
    held = {site: found for site, found in recorded.items() if found not in accepted}
    return TopologyDrift(topology, held, dict(failed_over or {})) if held else None


def unheld(topology: Topology, recorded: Mapping[str, str | None]) -> TopologyDrift | None:
    """``drift`` when none of the sites of ``recorded`` runs ``topology`` (the file is stale or not
    applied anywhere); None when some do (the others are behind it: a site a failover could not
    reach, or one rejoining)."""
    found = drift(topology, recorded)
    return found if found is not None and topology.topology_config_id not in recorded.values() else None
