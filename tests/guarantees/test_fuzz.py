"""Fuzzing the two parsers that take outside input: the topology loader (any document, any text)
and entry decoding (any bytes in the log or in a receive-queue row). Whatever the input, the
answer is a result or lr's own clear error, never a crash of another kind."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_provider_lr.engine import vocabulary
from airflow_provider_lr.engine.db import topology_schema
from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.sink import queue_rows
from airflow_provider_lr.engine.sink.receive import _entries, _Row
from airflow_provider_lr.engine.store import topology
from airflow_provider_lr.proto import lr_pb2

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20))
json_like = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=25,
)
names = st.one_of(st.sampled_from(["a", "b", "site-a", "policy", "a_b", "b_c", "x\n", "", "A"]), st.text(max_size=8))
near_valid = st.fixed_dictionaries(
    {
        "sites": st.lists(
            st.fixed_dictionaries({"id": names}, optional={"region": scalars, "conn_id": scalars, "regoin": scalars}),
            max_size=4,
        )
    },
    optional={
        "replication": st.lists(
            st.fixed_dictionaries(
                {"source": names, "sinks": st.one_of(names, st.lists(names, max_size=3))},
                optional={"clients": st.one_of(names, st.lists(names, max_size=3))},
            ),
            max_size=3,
        ),
        "settings": st.dictionaries(
            st.sampled_from(["lease_seconds", "tee_min_backlog", "max_payload_bytes", "x"]), scalars, max_size=3
        ),
        "providers": st.dictionaries(names, st.one_of(st.text(max_size=20), st.just("m.mod:f")), max_size=2),
        "replications": json_like,
    },
)


def _load(doc) -> None:
    try:
        topo = topology.from_document(doc)
    except ConfigurationError as exc:
        assert "\n" not in str(exc).strip(), "errors are one line"
        return
    assert topo.sites and all(topology_schema.valid_site_id(s) for s in topo.sites)
    for key in topo.sessions():
        assert key.sink in topo.sites and key.source in topo.sites and topology_schema.valid_client_name(key.client)


@FUZZ
@given(st.one_of(json_like, near_valid))
def test_any_topology_document_loads_or_is_refused_with_a_configuration_error(doc):
    _load(doc)


@FUZZ
@given(st.text(max_size=200))
def test_any_topology_text_parses_or_is_refused_with_a_configuration_error(text):
    try:
        doc, origin = topology_schema.parse(text, "fuzz.yaml")
    except ConfigurationError as exc:
        assert str(exc).startswith("fuzz.yaml")
        return
    try:
        topology.from_document(doc, origin)
    except ConfigurationError as exc:
        assert str(exc).startswith("fuzz.yaml")


entries = st.builds(
    lambda dests, kind, payload, source: lr_pb2.RoutingTableEntryMsg(
        destinations=dests, type=kind, opaque_payload=payload, source_site_id=source
    ).SerializeToString(),
    st.lists(st.text(max_size=140), max_size=4),
    st.sampled_from([0, 1, 2, 3, 4, 200]),
    st.binary(max_size=64),
    st.text(max_size=10),
)


@FUZZ
@given(entries)
def test_the_byte_level_strip_equals_parse_clear_serialize_on_every_well_formed_entry(message):
    assert vocabulary.strip_destinations(message) == vocabulary.rewrite_for_sink(message)


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_in_the_log_take_a_receive_queue_form_without_raising(message):
    """A corrupted entry is passed on (the subscriber dead-letters it), never a crash of the path."""
    kind, stripped = vocabulary.strip_destinations(message)
    assert isinstance(kind, int) and isinstance(stripped, bytes)


@FUZZ
@given(
    st.integers(min_value=-2, max_value=40),
    st.binary(max_size=300),
    st.integers(min_value=0, max_value=3),
    st.sampled_from([0, 1, 2, 3, 4, 9]),
)
def test_any_receive_queue_row_decodes_or_names_its_malformed_entry(count, message, delivered, kind):
    try:
        queue_rows.unpack(count, message)
    except ValueError:
        pass
    for entry in _entries([_Row(1, kind, count, delivered, message)], limit=50):
        assert entry.error is None or entry.error.strip()
        assert isinstance(entry.payload, bytes)
