"""Provider metadata Airflow discovers through the ``apache_airflow_provider`` entry point.

Airflow never reads a provider.yaml for third-party packages: everything it shows (connection
form fields included) comes from this dict. ``package-name`` must equal the distribution name.
"""

from __future__ import annotations

from airflow_provider_lr import __version__

INTEGRATION = "lr log replication"


def get_provider_info() -> dict:
    return {
        "package-name": "airflow-provider-lr",
        "name": "lr log replication",
        "description": "Log replication between PostgreSQL sites: routing queues carried exactly once and in "
        "order from a source site to every sink it names, orchestrated by Airflow, moved by Spark.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": INTEGRATION,
                "external-doc-url": "https://github.com/lr-replication/airflow-provider-lr",
                "tags": ["service"],
            }
        ],
        "hooks": [{"integration-name": INTEGRATION, "python-modules": ["airflow_provider_lr.hooks.site"]}],
        "operators": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [
                    "airflow_provider_lr.operators.session",
                    "airflow_provider_lr.operators.snapshot_sync",
                    "airflow_provider_lr.operators.maintenance",
                    "airflow_provider_lr.operators.spark",
                    "airflow_provider_lr.operators.fanout",
                ],
            }
        ],
        "sensors": [{"integration-name": INTEGRATION, "python-modules": ["airflow_provider_lr.sensors.session"]}],
        "triggers": [{"integration-name": INTEGRATION, "python-modules": ["airflow_provider_lr.triggers.session"]}],
        "connection-types": [
            {
                "connection-type": "lr_site",
                "hook-class-name": "airflow_provider_lr.hooks.site.LRSiteHook",
                "hook-name": "lr site (PostgreSQL)",
                "ui-field-behaviour": {
                    "hidden-fields": [],
                    "relabeling": {"schema": "Database"},
                    "placeholders": {"host": "127.0.0.1", "port": "5432", "login": "postgres", "schema": "postgres"},
                },
                "conn-fields": {
                    "site_id": {
                        "label": "Site id",
                        "description": "The lr site id of this database (lowercase letters, digits, '-' or '_'), "
                        "as recorded by `lr init`",
                        # topology_schema.form_pattern(SITE_ID_PATTERN) (a test checks): whole, no
                        # trailing newline, alike in the browser and in Python; this module imports nothing
                        "schema": {"type": ["string", "null"], "pattern": r"^(?:[a-z0-9][a-z0-9_-]{0,62})(?![\s\S])"},
                    },
                    "region": {
                        "label": "Region",
                        "description": "Failure domain of the site, used for region-aware durability",
                        "schema": {
                            "type": ["string", "null"],
                            "default": "default",
                            # form_pattern(PRINTABLE_PATTERN)
                            "pattern": r"^(?:[^\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]{1,63})(?![\s\S])",
                        },
                    },
                },
            }
        ],
    }
