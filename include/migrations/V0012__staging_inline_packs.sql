-- lr schema v12: staged packs stay inline (engine/bulk/staged_tee.py, engine/bulk/snapshot_transfer.py).
--
-- Both Spark paths stage packed receive-queue rows (~7.9 kB each) in lr.spark_staging. With the
-- default toast_tuple_target (2 kB) every pack was compressed (in vain: payloads are opaque) and
-- cut into TOAST chunks on the way in, then read back and reassembled when the publish or the
-- snapshot move copies it into lr.receive_queue, which keeps its packs inline (V0005). The
-- staging table now keeps them inline too.
ALTER TABLE lr.spark_staging SET (toast_tuple_target = 8160);
