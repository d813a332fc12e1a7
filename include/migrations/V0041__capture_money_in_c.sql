-- lr schema v41: the capture of federated tables' changes prints money under lc_monetary 'C'
-- ('$1,234.50'), as lr's sink applies read it (tables/sink.py, APPLYING_SQL). Before, a change's
-- money was printed by the writer's lc_monetary and read by the sink session's: between sites
-- whose lc_monetary differ the amount was read wrong ('1234.5' is 12.345,00 € under de_DE) or
-- refused for good (a de_DE sink refuses '$1,234.50'), the batch and every later change of the
-- session with it. A later CREATE OR REPLACE of the function must keep this setting (it replaces
-- the function's SET clauses).
ALTER FUNCTION lr.capture_table_changes() SET lc_monetary = 'C';
