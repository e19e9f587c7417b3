-- Gives SQLite's query planner the statistics `ANALYZE` gathers on a populated SPIRE
-- datastore, on a fresh one (`--datastore sqlite-analyzed`, tests/common/sqlite.rs).
--
-- Why: before creating an entry SPIRE looks for a similar one with
--   parent_id = ? AND spiffe_id = ? (INTERSECT the entries with each selector).
-- Without statistics SQLite picks the parent_id index for that, and every entry of a
-- registrar shares one parent, so each create scans all entries under it: creates slow from
-- ~270/s into an empty table to ~10/s at 24,000 entries. With statistics it picks spiffe_id
-- (10.4 ms → 0.5 ms per lookup at 30,000 entries, measured with this schema).
--
-- Seed rows shaped like a registrar's (one parent, 50 namespaces, one service account each)
-- exist only inside this transaction: SPIRE never sees them, and ANALYZE keeps what it learnt.
BEGIN IMMEDIATE;
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)
INSERT INTO registered_entries (entry_id, spiffe_id, parent_id, hint)
  SELECT 'planner-seed-' || i, 'spiffe://planner.seed/ns/n' || (i % 50) || '/sa/s' || i,
         'spiffe://planner.seed/parent', 'planner-seed' FROM n;
INSERT INTO selectors (registered_entry_id, type, value)
  SELECT id, 'k8s', 'ns:n' || (id % 50) FROM registered_entries WHERE hint = 'planner-seed';
INSERT INTO selectors (registered_entry_id, type, value)
  SELECT id, 'k8s', 'sa:s' || id FROM registered_entries WHERE hint = 'planner-seed';
ANALYZE;
DELETE FROM selectors
  WHERE registered_entry_id IN (SELECT id FROM registered_entries WHERE hint = 'planner-seed');
DELETE FROM registered_entries WHERE hint = 'planner-seed';
COMMIT;
