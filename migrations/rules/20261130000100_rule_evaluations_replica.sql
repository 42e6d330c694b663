-- Which replica ran each evaluation (the harness passes CRAIG_REPLICA; NULL elsewhere), so a
-- re-execution can be attributed to a fault of the replica that ran the FIRST execution —
-- the only one whose #1180 window (handler committed, processed_at not stamped) it can be.
ALTER TABLE rule_evaluations ADD COLUMN replica TEXT;
