"""lr: log replication between PostgreSQL sites, as an Apache Airflow provider.

Importing this package imports neither Airflow nor Spark: the engine (``airflow_provider_lr.engine``)
is pure Python over PostgreSQL, and the Airflow and Spark adapters import it, never the reverse.
"""

__version__ = "0.1.0"
