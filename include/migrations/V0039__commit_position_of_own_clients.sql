-- lr schema v39: lr.commit_position_of (V0009), a writer's look-up of its transaction's commit
-- position while it waits on a ticket, answers only for a transaction that wrote an entry of a
-- client the caller may read (lr.caller_reads_client, V0036: a client it is a writer of; any for a
-- replicator or the lr schema's owner). Before, a writer of one client could ask it about any
-- transaction id and learn which transactions of other applications wrote to the log, when (their
-- commit order) and how they interleave with its own: what docs/security.md keeps from a writer
-- (another client's stream). Another client's transaction now reads as one with no entries (NULL),
-- as a transaction that never wrote to the log does: the answer says nothing of other clients.
CREATE OR REPLACE FUNCTION lr.commit_position_of(txid xid8) RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT c.position FROM lr.log_commits c
    WHERE c.tx = txid
      AND EXISTS (SELECT 1 FROM lr.log_entries e JOIN lr.clients k ON k.client_id = e.client_id
                  WHERE e.tx = txid AND lr.caller_reads_client(k.client_name))
$$;
