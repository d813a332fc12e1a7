"""``python -m airflow_provider_lr.cli``: the ``lr`` command."""

import sys

from airflow_provider_lr.cli import main

sys.exit(main())
