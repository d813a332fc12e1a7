"""Public source-side API (the README's "Transmit"): transmit payloads inside your transaction."""

from airflow_provider_lr.engine.errors import DeliveryTimeout
from airflow_provider_lr.engine.source.delivery import Delivery, DeliveryState, Ticket
from airflow_provider_lr.engine.source.transmit import LRMessageWithDestinations, RoutingQueueClient

__all__ = ["Delivery", "DeliveryState", "DeliveryTimeout", "LRMessageWithDestinations", "RoutingQueueClient", "Ticket"]
