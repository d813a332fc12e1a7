"""lr's status as Prometheus metrics (text exposition format 0.0.4): the same live figures as
``lr status``, for the monitoring people already run (a node_exporter textfile collector fed by
``lr metrics > file``, or a scrape of ``lr metrics --listen host:port``)."""
from __future__ import annotations

import http.server
from typing import Callable

from airflow_provider_lr.engine.site.status import SiteStatus, readiness, trim_marks
from airflow_provider_lr.engine.site.topology import Topology

# Every metric is a gauge: each sample is a level read at scrape time (lag, waiting entries, ages),
# not a count kept by this process, so the help text is all that differs.
_HELP = {
    "lr_site_up": "1 when the site could be read",
    "lr_site_topology_matches_file": "1 when the site runs the topology of the file lr read (0: a stale or unapplied file)",
    "lr_session_lag_entries": "committed entries not yet acknowledged by the sink",
    "lr_session_lag_seconds": "age of the oldest committed entry not yet acknowledged by the sink",
    "lr_session_ready": "1 when the sink holds everything committed for it (source side)",
    "lr_session_error": "1 when the session's last step failed",
    "lr_session_last_success_age_seconds": "seconds since the session last completed a step",
    "lr_full_sync_requests_open": "full-sync requests pending or supplied, not applied yet",
    "lr_receive_queue_waiting_entries": "entries in a receive queue not yet consumed by subscribers",
    "lr_receive_queue_oldest_seconds": "age of the oldest entry waiting in a receive queue",
    "lr_receive_queue_dead_letters": "entries moved to dead letters",
    "lr_log_held_back": "transactions holding the log's read barrier or with uncommitted entries",
    "lr_log_trim_mark": "commit position up to which the site's log is trimmed",
    "lr_tables_diverged": "federated tables of the site that do not replicate (lr status: DIVERGED)",
}


def _labels(**values: str) -> str:
    def quote(v: str) -> str:
        return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{quote(v)}"' for k, v in values.items()) + "}"


def exposition(found: dict[str, SiteStatus | str], topology: Topology | None = None) -> str:
    """Every site's metrics; a site that could not be read is ``lr_site_up 0``. With the
    ``topology`` read from a file, whether each site runs it (``lr status``'s file check)."""
    samples: dict[str, list[str]] = {name: [] for name in _HELP}
    marks = trim_marks(found)
    for site, st in found.items():
        samples["lr_site_up"].append(f"{_labels(site=site)} {0 if isinstance(st, str) else 1}")
        if isinstance(st, str):
            continue
        if topology is not None:
            matches = st.topology_config_id == topology.topology_config_id
            samples["lr_site_topology_matches_file"].append(f"{_labels(site=site)} {int(matches)}")
        samples["lr_log_trim_mark"].append(f"{_labels(site=site)} {st.trim_mark}")
        samples["lr_log_held_back"].append(f"{_labels(site=site)} {len(st.held_back_by)}")
        samples["lr_tables_diverged"].append(f"{_labels(site=site)} {len(st.diverged)}")
        for s in st.sessions:
            if s["role"] != "source":
                continue
            labels = _labels(source=s["source_site_id"], sink=s["sink_site_id"], client=s["client_name"])
            samples["lr_session_lag_entries"].append(f"{labels} {s['remaining_entries_to_send'] or 0}")
            samples["lr_session_lag_seconds"].append(f"{labels} {s.get('lag_seconds') or 0.0}")
            ready = readiness(s, marks.get(s["source_site_id"])) == "ready"
            samples["lr_session_ready"].append(f"{labels} {int(ready)}")
            samples["lr_session_error"].append(f"{labels} {int(bool(s.get('last_error')))}")
            if s.get("last_success_age_s") is not None:
                samples["lr_session_last_success_age_seconds"].append(f"{labels} {s['last_success_age_s']}")
        for r in st.full_sync_requests:
            samples["lr_full_sync_requests_open"].append(
                f"{_labels(source=site, sink=r['sink'], client=r['client'], status=r['status'])} 1")
        for q in st.receive_queues:
            labels = _labels(sink=site, source=q["source"], client=q["client"])
            samples["lr_receive_queue_waiting_entries"].append(f"{labels} {q['waiting']}")
            samples["lr_receive_queue_oldest_seconds"].append(f"{labels} {q['oldest_waiting_s']}")
            samples["lr_receive_queue_dead_letters"].append(f"{labels} {q['dead_letters']}")
    lines = []
    for name, text in _HELP.items():
        lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge"] + [f"{name}{sample}" for sample in samples[name]]
    return "\n".join(lines) + "\n"


def serve(render: Callable[[], str], listen: str) -> int:
    """Serve ``/metrics`` (computed on each scrape) on ``host:port`` until interrupted."""
    host, _, port = listen.rpartition(":")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics here")
                return
            body = render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
            pass

    server = http.server.ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
