"""Public source-side API (``../shared/DESIGN.md`` §5): transmit payloads inside your transaction."""
from airflow_provider_lr.engine.source.transmit import LRMessageWithDestinations, RoutingQueueClient

__all__ = ["LRMessageWithDestinations", "RoutingQueueClient"]
