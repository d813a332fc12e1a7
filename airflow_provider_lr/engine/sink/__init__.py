"""The sink site: the writes that apply a session's batches, the receive queues subscribers read
from, the packed queue rows, bulk apply and the relay."""
