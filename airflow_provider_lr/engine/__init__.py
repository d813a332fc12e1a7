"""The replication engine: pure Python over PostgreSQL (psycopg2) and protobuf.

Every rule of the system lives here once. Nothing in this package may import Airflow or Spark
(a test enforces it); hooks, operators, sensors, triggers and Spark jobs are thin adapters over it.
"""
