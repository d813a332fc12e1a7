"""The package is an Airflow provider: discoverable, schema-valid metadata, generated code up to date."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from importlib import metadata, resources
from pathlib import Path

import jsonschema

from airflow_provider_lr.get_provider_info import get_provider_info
from airflow_provider_lr.proto import build, lr_pb2

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_provider_lr"


def test_provider_info_is_valid_against_airflows_schema():
    info = get_provider_info()
    schema = json.loads(resources.files("airflow").joinpath("provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    assert info["package-name"] == metadata.distribution("airflow-provider-lr").metadata["Name"]
    conn_type = info["connection-types"][0]
    assert conn_type["connection-type"] == "lr_site"
    assert set(conn_type["conn-fields"]) == {"site_id", "region"}


def test_entry_point_and_airflow_providers_list():
    eps = [ep for ep in metadata.entry_points(group="apache_airflow_provider") if ep.dist.name == "airflow-provider-lr"]
    assert [ep.load()()["package-name"] for ep in eps] == ["airflow-provider-lr"]
    out = subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), "providers", "list", "-o", "json"],
        capture_output=True, text=True, check=True, env=os.environ, timeout=300,
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
        destinations=["site-b", "site-c"], type=lr_pb2.LOG_ENTRY_SYNC, opaque_payload=b"\x00\xff", source_site_id="site-a"
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
