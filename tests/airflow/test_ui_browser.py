"""The real Airflow UI in a real browser: ``airflow standalone`` (scheduler, dag-processor,
triggerer, api-server) on loopback with this repo's ``lr_full_sync`` and ``lr_replication`` DAGs
and real embedded sites, driven by headless Chromium through Playwright the way an operator does
it: log in with the generated admin password, open ``lr_full_sync``, fill the trigger form (sink,
reason), submit, and wait until the full sync is applied at the sink. Screenshots of every step go
to ``$LR_ARTIFACTS/browser`` (default ``artifacts/browser`` under the repository root) so a failure
can be looked at.

Needs Debian's ``chromium`` (``./dev.sh test`` installs it when running as root); without it the
test is skipped, saying so. Airflow runs in its own process group, stopped as a group at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.airflow_env import DAGS_DIR, airflow_sites  # noqa: F401
from tests.support.session import App, final_state, queue, source_state

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("LR_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-extensions",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
STARTUP_TIMEOUT = 150  # api-server healthy and the DAGs parsed (about 50 s on 2 cores)
RUN_TIMEOUT = 90
# The DAGs in standalone's DAG folder (links to the repo's files): the ones the test waits for. The
# dag-processor takes seconds of CPU per file on two cores and, by default, parses each again every
# 30 s; with all seven shipped DAGs (test_dags.py parses them all) lr_full_sync was often parsed last,
# and the others were parsed again while the run ran.
UI_DAGS = ("lr_full_sync", "lr_replication")

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def _skip_reason() -> str | None:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        how = "./dev.sh test installs it when run as root" if os.geteuid() != 0 else "apt-get install chromium"
        return f"the browser test needs Debian's chromium at {CHROMIUM} (not found; {how})"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the browser test needs the playwright package (requirements/lock.txt; ./dev.sh install)"
    return None


def artifacts_dir() -> Path:
    root = Path(os.environ.get("LR_ARTIFACTS") or REPO / "artifacts")
    path = root / "browser"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Airflow:
    """``airflow standalone`` in its own process group, with a REST client for checks."""

    def __init__(self, home: Path, env: dict[str, str], port: int, log_path: Path) -> None:
        self.home, self.env, self.port, self.log_path = home, env, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.token: str | None = None

    def start(self) -> None:
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "airflow"), "standalone"],
            env=self.env,
            cwd=self.home,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self) -> None:
        """SIGTERM to the whole group (every component shuts down on it), SIGKILL to what is left
        after 2 s: a throwaway test installation needs no graceful drain."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        for sig, wait in ((signal.SIGTERM, 2), (signal.SIGKILL, 5)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()

    def password(self) -> str:
        path = self.home / "simple_auth_manager_passwords.json.generated"
        return json.loads(path.read_text())["admin"]

    def request(self, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        headers = {"Content-Type": "application/json"}
        if auth and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read() or b"null")

    def wait_ready(self, dag_ids: list[str]) -> None:
        """The api-server answers, admin's password is written and the DAGs are parsed."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        why = "not started"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"airflow standalone exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if self.token is None:
                    self.token = self.request(
                        "POST", "/auth/token", {"username": "admin", "password": self.password()}, auth=False
                    )["access_token"]
                found = {d["dag_id"] for d in self.request("GET", "/api/v2/dags?limit=100")["dags"]}
                if set(dag_ids) <= found:
                    # the execution API (what task processes call) builds its versioned routes at its
                    # first request, blocking the api-server meanwhile: pay that before any task runs
                    began = time.monotonic()
                    self.request("GET", "/execution/health", auth=False)
                    print(f"execution API warmed up in {time.monotonic() - began:.1f}s")
                    return
                why = f"DAGs parsed so far: {sorted(found)}"
            except (OSError, urllib.error.URLError, KeyError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
        raise AssertionError(f"Airflow not ready after {STARTUP_TIMEOUT}s ({why}); see {self.log_path}")


def _group_alive(pgid: int) -> bool:
    """A process of the group still runs; zombies do not count (the unreaped leader, or children
    whose new parent reaps them late), else the stop would wait its whole grace for nothing."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state != "Z":
            return True
    return False


@pytest.fixture
def statsd_socket() -> Iterator[tuple[int, list[str]]]:
    """A StatsD listener on loopback: (port, lines received)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    received: list[str] = []
    stop = threading.Event()

    def receive() -> None:
        while not stop.is_set():
            try:
                received.extend(line for line in sock.recv(65536).decode().splitlines() if line)
            except OSError:
                continue

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    yield sock.getsockname()[1], received
    stop.set()
    thread.join()
    sock.close()


@pytest.fixture
def airflow_ui(airflow_sites, tmp_path: Path, statsd_socket) -> Iterator[Airflow]:  # noqa: F811
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    home = tmp_path / "airflow-home"
    dags = home / "dags"
    dags.mkdir(parents=True)
    for dag_id in UI_DAGS:
        (dags / f"{dag_id}.py").symlink_to(DAGS_DIR / f"{dag_id}.py")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__") and k != "AIRFLOW_HOME"}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",  # parsed once: nothing changes them
            "AIRFLOW__CORE__PARALLELISM": "4",  # the run's tasks at once, not 32 forked LocalExecutor workers
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
            "AIRFLOW__METRICS__STATSD_ON": "True",
            "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
            "AIRFLOW__METRICS__STATSD_PORT": str(statsd_socket[0]),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),  # the test's provider
            # standalone starts its components as `airflow ...` from PATH: this venv's
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        }
    )
    airflow = Airflow(home, env, port, artifacts_dir() / "airflow-standalone.log")
    started = time.monotonic()
    airflow.start()
    try:
        airflow.wait_ready(list(UI_DAGS))
        print(f"airflow standalone ready in {time.monotonic() - started:.0f}s")
        yield airflow
    finally:
        stopping = time.monotonic()
        airflow.stop()
        print(f"airflow standalone stopped in {time.monotonic() - stopping:.0f}s")
        for name in ("logs",):  # the task logs, beside the screenshots
            if (home / name).is_dir():
                shutil.copytree(home / name, artifacts_dir() / "airflow-logs", dirs_exist_ok=True)


def _statsd_names(lines: list[str]) -> set[str]:
    return {line.split(":", 1)[0] for line in lines}


def test_an_operator_triggers_a_full_sync_from_the_ui_form(airflow_ui, airflow_sites, statsd_socket):  # noqa: F811
    from playwright.sync_api import sync_playwright

    source, sink_b, sink_c = airflow_sites.sites
    app = App(source)
    for i in range(3):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    shots = artifacts_dir()
    # DAGs start paused; unpause the one we trigger (the dialog's "unpause" toggle does the same)
    airflow_ui.request("PATCH", "/api/v2/dags/lr_full_sync", {"is_paused": False})

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(30_000)
        try:
            # log in as the admin standalone created (its password is in the generated file)
            page.goto(airflow_ui.url + "/")
            page.get_by_role("textbox", name="username").fill("admin")
            page.get_by_label("password").fill(airflow_ui.password())
            page.screenshot(path=str(shots / "01-login.png"))
            page.get_by_role("button", name="Sign in", exact=False).click()
            page.wait_for_url(lambda url: "/auth/login" not in url)

            # the DAG, its Trigger button, the form
            page.goto(airflow_ui.url + "/dags/lr_full_sync")
            page.locator('[data-testid="trigger-dag-button"], button[aria-label="Trigger"]').first.click()
            sink = page.get_by_role("combobox", name="Sink site")
            sink.wait_for()
            client = page.locator("#element_client")
            assert "null" not in client.inner_text()  # an empty optional select shows as empty
            page.screenshot(path=str(shots / "02-trigger-form-empty.png"))
            sink.click()
            page.get_by_role("option", name="site-b", exact=True).click()
            page.locator("#element_reason").fill("browser test: audit asked for it")
            page.screenshot(path=str(shots / "03-trigger-form-filled.png"))
            with page.expect_response(lambda r: r.request.method == "POST" and r.url.endswith("/dagRuns")) as posted:
                page.locator('[data-testid="trigger-dag-submit"]').click()
            assert posted.value.status == 200, posted.value.text()
            run_id = posted.value.json()["dag_run_id"]
            assert posted.value.json()["conf"] == {
                "sink": "site-b",
                "client": None,
                "source": None,
                "reason": "browser test: audit asked for it",
            }

            # the run, as the API and the sink see it
            state = _wait_for_run(airflow_ui, "lr_full_sync", run_id)
            page.goto(f"{airflow_ui.url}/dags/lr_full_sync/runs/{run_id}")
            page.get_by_text("site-a->site-b/policy").first.wait_for()
            page.screenshot(path=str(shots / "04-run-tasks-by-session.png"))
        finally:
            page.screenshot(path=str(shots / "99-last.png"))
            browser.close()

    tis = airflow_ui.request("GET", f"/api/v2/dags/lr_full_sync/dagRuns/{run_id}/taskInstances")["task_instances"]
    got = {(t["task_id"], t["rendered_map_index"] or t["map_index"]): t["state"] for t in tis}
    assert state == "success", got
    assert got[("snapshot_sync", "site-a->site-b/policy")] == "success"
    assert got[("log_entry_sync", "site-a->site-b/policy")] == "success"
    assert got[("check", -1)] == "success"
    # the full sync arrived at the chosen sink only, with the reason recorded on the source
    q = queue(sink_b, "site-a")
    assert q[0] == ("start", "") and ("end", "") in q and final_state(q) == source_state(source)
    assert sink_b.query("SELECT count(*) FROM lr.sink_sessions WHERE snapshot_applied >= 0")[0][0] == 1
    assert not queue(sink_c, "site-a")
    assert source.query("SELECT reason, status FROM lr.full_sync_requests WHERE forced") == [
        ("browser test: audit asked for it", "applied")
    ]
    # the tasks' metrics went out through Airflow's StatsD client
    names = _statsd_names(statsd_socket[1])
    assert "airflow.lr.session.site-a.site-b.policy.snapshot_messages" in names, sorted(names)[:50]
    assert "airflow.lr.run.lr_full_sync.failed_sessions" in names
    app.close()


def _wait_for_run(airflow: Airflow, dag_id: str, run_id: str) -> str:
    deadline = time.monotonic() + RUN_TIMEOUT
    state = "?"
    while time.monotonic() < deadline:
        try:
            state = airflow.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]
        except (OSError, urllib.error.URLError) as exc:  # SQLite busy in a component: ask again
            state = f"unknown ({exc})"
        if state in ("success", "failed"):
            return state
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} still {state} after {RUN_TIMEOUT}s")
