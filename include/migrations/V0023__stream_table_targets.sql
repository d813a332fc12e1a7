-- lr schema v23: a stream's table changes in its one-round-trip sink transaction. The statements
-- that apply a federated table's changes are composed from the table's target (the sink's table,
-- its shape, whether the source is its primary origin or shares it), which the sink reads inside
-- each transaction. A stream composes them from the targets its last transaction read and sends,
-- ahead of them, the same read with what it expects it to return: this asserts the two are equal,
-- else raises SQLSTATE LR409 like lr.stream_advance (the transaction is rolled back whole and the
-- stream takes the general path, which reads the targets before it composes anything;
-- engine/tables/targets.py owns the read, engine/sink/writes.py the rule).
CREATE FUNCTION lr.stream_expect(p_holds boolean, p_what text)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF p_holds IS NOT TRUE THEN
        RAISE EXCEPTION 'lr: %', p_what USING ERRCODE = 'LR409';
    END IF;
END
$$;
