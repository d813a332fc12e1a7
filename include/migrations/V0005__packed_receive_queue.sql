-- lr schema v5: several entries per receive-queue row (engine/queue_rows.py has the rule).
--
-- A sink paid per row (heap tuple, identity value, two index entries, WAL record) for every entry
-- it received; for small entries that was most of a catch-up's time. From now on a row holds
-- entry_count consecutive entries of its kind (entry_count > 1: message is a ReceiveQueueBatch of
-- RoutingTableEntryMsg; entry_count = 1: the RoutingTableEntryMsg itself, as every existing row).
-- delivered counts the leading entries a subscriber has consumed; the delivery that takes the
-- rest deletes the row.
ALTER TABLE lr.receive_queue
    ADD COLUMN entry_count integer NOT NULL DEFAULT 1,
    ADD COLUMN delivered integer NOT NULL DEFAULT 0;

-- A pack (< 8 KB) stays inline in its heap tuple: no TOAST chunks, no compression attempt on
-- incompressible payloads. Larger single entries are still toasted as before.
ALTER TABLE lr.receive_queue SET (toast_tuple_target = 8160);

-- A malformed entry inside a pack is moved aside alone: dead letters are keyed by the row and the
-- entry's index in it (-1: the whole row could not be unpacked).
ALTER TABLE lr.receive_dead_letters ADD COLUMN entry_index integer NOT NULL DEFAULT 0;
ALTER TABLE lr.receive_dead_letters DROP CONSTRAINT receive_dead_letters_pkey;
ALTER TABLE lr.receive_dead_letters ADD PRIMARY KEY (seq, entry_index);
