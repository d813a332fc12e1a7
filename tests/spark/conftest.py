"""The standalone clusters every module here shares, started once per test session: a fixture
imported into a test module is that module's own (a session-scoped one would start a cluster per
module); defined here it is one."""

from tests.support.spark_env import spark_cluster, two_host_cluster  # noqa: F401 (fixtures)
