"""Failover from Airflow: one task that calls the engine's failover (``engine/site/failover``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator

from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.site import failover
from airflow_provider_lr.engine.store.topology import Topology, failover_files, write_document
from airflow_provider_lr.hooks.site import LRSiteHook
from airflow_provider_lr.operators.common import final_refusals, load_topology, refusals_said


class LRFailoverOperator(BaseOperator):
    """Make ``promote`` the source of its source's clients (``from_site``: default, the one source
    it receives from), or with ``rejoin`` apply the failover's topology on a site it could not
    reach. Re-running it finishes an interrupted failover (the sites' records say what is done).
    ``allow_table_divergence``: promote even when the new source lacks a federated table another
    sink takes (its replication stops; ``lr status`` marks it). Returns a small summary (positions,
    what each sink's reconcile did, the tables taken over or diverged, the new topology id)."""

    template_fields: Sequence[str] = (
        "promote",
        "from_site",
        "clients",
        "reason",
        "rejoin",
        "same_destinations",
        "allow_table_divergence",
    )

    def __init__(
        self,
        *,
        promote: str | None = None,
        rejoin: str | None = None,
        from_site: str | None = None,
        clients: list[str] | None = None,
        reason: str = "failover from Airflow",
        same_destinations: bool | str = False,
        planned: bool | None = None,
        topology_path: str | None = None,
        allow_table_divergence: bool | str = False,
        **kwargs: Any,
    ) -> None:
        final_refusals(kwargs)  # a login without lr's grant: failed at once
        super().__init__(**kwargs)
        self.promote, self.rejoin, self.from_site, self.clients = promote, rejoin, from_site, clients
        self.reason, self.same_destinations, self.planned = reason, same_destinations, planned
        self.allow_table_divergence = allow_table_divergence
        self.topology_path = topology_path

    def execute(self, context: Any) -> dict[str, Any]:
        with refusals_said(self.log, f"lr {'rejoin of ' + self.rejoin if self.rejoin else 'failover'}"):
            return self._execute()

    def _execute(self) -> dict[str, Any]:
        topo = load_topology(self.topology_path)

        def connect(site_id: str):
            return LRSiteHook(lr_conn_id=topo.conn_id(site_id), timeouts=topo.timeouts).connect_replication(site_id)

        if self.rejoin:
            back = failover.rejoin(self.rejoin, connect, topo)
            self.log.info(
                "%s rejoined: retired %s; committed after the cut, received by nobody: %s",
                back.site,
                back.retired,
                back.tail,
            )
            return {
                "site": back.site,
                "failover_id": back.failover_id,
                "retired": back.retired,
                "tail": back.tail,
                "table_tail": back.table_tail,
                "guarded": back.guarded,
                "reopened": back.reopened,
                "topology_config_id": back.topology_config_id,
            }
        if not self.promote:
            raise ConfigurationError("LRFailoverOperator needs promote (the new source) or rejoin (a site to rejoin)")
        old = self.from_site or failover.only_source(topo, self.promote, self.clients or None)
        done = failover.promote(
            failover.FailoverRequest(
                old,
                self.promote,
                clients=self.clients or None,
                reason=self.reason,
                same_destinations=self.same_destinations in (True, "True", "true"),
                planned=self.planned,
                allow_table_divergence=self.allow_table_divergence in (True, "True", "true"),
            ),
            connect,
            topology=topo,
        )
        self.log.info(
            "failover %s: %s is the source of %s (was %s); cut %s; lost: %s",
            done.failover_id,
            done.to_site,
            done.clients,
            done.from_site,
            done.positions,
            done.lost,
        )
        for table in done.diverged:
            self.log.warning("DIVERGED table %s: its replication stops", table)
        written = self._write_topology(topo, done.topology)
        for site in done.pending:
            self.log.warning("%s was not reached: rejoin it when it is back", site)
        return {
            "failover_id": done.failover_id,
            "from": done.from_site,
            "to": done.to_site,
            "clients": done.clients,
            "positions": done.positions,
            "base": done.base,
            "planned": done.planned,
            "outcome": done.outcome,
            "full_syncs": done.full_syncs,
            "pending": done.pending,
            "lost": done.lost,
            "tables": done.tables,
            "diverged": done.diverged,
            "topology_config_id": done.topology.topology_config_id,
            "topology": done.topology.document,
            "topology_file": written,
        }

    def _write_topology(self, read: Topology, new: Topology) -> str | None:
        """The new topology, as a file beside the one this task read (what the DAGs read next is
        the operator's to point at it: ``lr_topology`` or ``$LR_TOPOLOGY``), said in the log. Every
        other task refused the old file after the failover, and the log did not say where the new
        one was (only the XCom held its document)."""
        target = failover_files(new.topology_config_id, read.path)[-1]
        try:
            out = str(write_document(new, target))
        except OSError as exc:
            self.log.warning(
                "could not write the new topology to %s (%s); it is this task's XCom 'topology'", target, exc
            )
            return None
        self.log.info(
            "new topology %s written to %s: every lr task refuses %s from now on; set the Variable "
            "lr_topology (or $LR_TOPOLOGY of every Airflow component, and of lr) to %s",
            new.topology_config_id,
            out,
            read.path or "the topology it read",
            out,
        )
        return out
