-- ADR-022 #1179: the uniqueness arbiter on a natural key from immutable event data. LIFETIME
-- semantics: the constraint covers every row whatever its status, so voiding a payment does
-- not free its key (a replayed placement.activated must never pay a voided period again).
-- The consumer inserts with ON CONFLICT ON CONSTRAINT payments_one_perdiem_per_placement_period
-- DO NOTHING and runs every side effect only on a real insert.
ALTER TABLE payments
    ADD CONSTRAINT payments_one_perdiem_per_placement_period UNIQUE (placement_id, period_start);
