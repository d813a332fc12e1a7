"""The lr schema's versioned migrations, shipped as package data ``airflow_provider_lr.migrations``
(setup.cfg maps this directory there) and read with ``importlib.resources`` by ``engine/site/schema``.

Never edit a released migration: each one's checksum is recorded on every site that applied it.
"""
