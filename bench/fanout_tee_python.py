"""The tee's own Python per entry, with no server (docs/spark.md, "Where the tee's time goes"): the
router (``bulk/router.CopyRouter``) fed the rows of a chunk's source COPY as PostgreSQL sends them
(one ``write`` per row: a group of entries, cut into their packed form where they begin with a
lead of the chunk's first entries, as ``router.copy_and_route``'s query forms them), routing to 3
sessions, packing (``queue_rows.Packer``) and forming their COPY blocks
(``pgcopy.ReceiveQueueWriter``), which are dropped instead of sent. What it leaves out: the source
server's work and psycopg2's side of the COPY (reading the rows, sending the blocks), measured by
``fanout_bench``'s ``lr_inprocess_tee`` (its ``cpu_s``).

Run: .venv/bin/python bench/fanout_tee_python.py [--entries 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airflow_provider_lr.engine import vocabulary  # noqa: E402
from airflow_provider_lr.engine.bulk import pgcopy, router  # noqa: E402
from airflow_provider_lr.engine.sink import queue_rows  # noqa: E402
from airflow_provider_lr.engine.sink.queue_rows import Packer  # noqa: E402
from airflow_provider_lr.engine.store.receive_queue import QueueWriter  # noqa: E402
from airflow_provider_lr.proto import lr_pb2  # noqa: E402

SINKS = 3


class DroppedBlocks(pgcopy.ReceiveQueueWriter):
    """A session's rows formed as for its sink, each block joined and then dropped (no connection)."""

    def __init__(self) -> None:  # no sink, no sender thread
        self.queue = QueueWriter("bench-src", "bench")
        self.block_bytes = pgcopy.DEFAULT_BLOCK_BYTES
        self.block, self.size, self.rows, self.flushes = [pgcopy.HEADER], len(pgcopy.HEADER), 0, 0
        self.packer = Packer(self._add_row)
        self.append = self.packer.append
        self.bytes = 0

    def flush(self) -> None:
        self.bytes += len(b"".join(self.block))
        self.block, self.size = [pgcopy.HEADER], len(pgcopy.HEADER)

    def sync(self) -> None:
        self.packer.flush()
        self.flush()


def source_entries(entries: int, variant: str, per_txn: int = 1000) -> list[tuple[int, int, int, bytes]]:
    """(position, entry id, mask, message) of a chunk: 256-byte payloads, to every sink ("all") or a random subset."""
    rng = random.Random(1)
    out = []
    for n in range(entries):
        mask = (1 << SINKS) - 1 if variant == "all" else rng.randint(1, (1 << SINKS) - 1)
        message = lr_pb2.RoutingTableEntryMsg(
            destinations=[f"bench-s{i}" for i in range(SINKS) if mask >> i & 1],
            type=lr_pb2.LOG_ENTRY_SYNC,
            opaque_payload=rng.randbytes(256),
            source_site_id="bench-src",
            client_name="bench",
        ).SerializeToString()
        out.append((1 + n // per_txn, n + 1, mask, message))
    return out


def _array(values: list[int], width: int) -> bytes:
    """A one-dimensional int8 (``width`` 8) or int4 array field in binary COPY form."""
    head = struct.pack(">iiiii", 1, 0, 20 if width == 8 else 23, len(values), 1)
    body = b"".join(struct.pack(">i", width) + v.to_bytes(width, "big", signed=True) for v in values)
    return struct.pack(">i", len(head) + len(body)) + head + body


def group_row(position: int, group: list[tuple[int, int, bytes, int]]) -> bytes:
    """One row of the chunk's COPY as the source sends it (``router._chunk_sql``): a group's
    position, ids, masks, sizes and its entries (packed forms, or whole) end to end."""
    items = b"".join(item for _, _, item, _ in group)
    return (
        struct.pack(">hiq", 5, 8, position)
        + _array([entry_id for entry_id, _, _, _ in group], 8)
        + _array([mask for _, mask, _, _ in group], 8)
        + _array([size for _, _, _, size in group], 4)
        + struct.pack(">i", len(items))
        + items
    )


def source_rows(entries: list[tuple[int, int, int, bytes]]) -> list[bytes]:
    """The chunk's COPY rows as the source forms them: grouped (``router.GROUP_ENTRIES`` of a
    commit, a larger entry than ``router.GROUP_ENTRY_BYTES`` alone), an entry that begins with one
    of the leading records of the first ``router.SAMPLE_ENTRIES`` cut into its packed form."""
    counts: dict[bytes, int] = {}
    for _, _, _, message in entries[: router.SAMPLE_ENTRIES]:
        _, form = vocabulary.sink_form_at(message, 0)
        counts[message[: form + 2]] = counts.get(message[: form + 2], 0) + 1
    leads = sorted(counts, key=counts.__getitem__, reverse=True)[: router.MAX_LEADS]
    groups: dict[tuple[int, int, int], list[tuple[int, int, bytes, int]]] = {}
    for position, entry_id, mask, message in entries:
        large = entry_id if len(message) > router.GROUP_ENTRY_BYTES else 0
        lead = next((lead for lead in leads if message.startswith(lead)), None) if not large else None
        item = queue_rows.piece(message[len(lead) - 2 :]) if lead else message
        size = len(item) if lead else -len(message)
        groups.setdefault((position, entry_id // router.GROUP_ENTRIES, large), []).append((entry_id, mask, item, size))
    rows = [group_row(key[0], group) for key, group in sorted(groups.items())]
    rows[0] = pgcopy.HEADER + rows[0]
    rows.append(pgcopy.TRAILER)
    return rows


def tee_python_us(rows: list[bytes], entries: int) -> float:
    """CPU µs per entry of routing, packing and forming the blocks of ``rows``."""
    sessions = {bit: DroppedBlocks() for bit in range(SINKS)}
    reader = router.CopyRouter(dict(sessions), -1, None)
    started = time.process_time()
    write = reader.write
    for row in rows:
        write(row)
    reader.finish()
    for session in sessions.values():
        session.sync()
    return (time.process_time() - started) / entries * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    for variant in ("all", "subset"):
        rows = source_rows(source_entries(args.entries, variant))
        best = min(tee_python_us(rows, args.entries) for _ in range(args.rounds))
        print(f"{variant}: {best:.2f} µs of the tee's Python per entry (best of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
