-- financial service domain tables (CONTRACT § fleet): the per-diem payment a
-- placement.activated event creates (ADR-022 #1179, the reference shape of an idempotent
-- money-path consumer). The uniqueness arbiter is its own migration
-- (20261201000200_payments_arbiter.sql): the schema before it is the one a pre-#1179
-- fleet ran (`craig-node migrate --compat pre-1179`).

-- The dependency the handler looks up AFTER the early probe: the daily rate per care level.
CREATE TABLE perdiem_rates (
    care_level   TEXT PRIMARY KEY,
    daily_cents  BIGINT NOT NULL CHECK (daily_cents > 0),
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
INSERT INTO perdiem_rates (care_level, daily_cents) VALUES ('standard', 12000), ('enhanced', 18500);

-- One row per per-diem payment. placement_id, period_start, days and care_level come from
-- the event's immutable payload; amount_cents is derived (days x the rate at derivation).
CREATE TABLE payments (
    id            UUID PRIMARY KEY DEFAULT uuidv7(),
    placement_id  UUID NOT NULL,
    period_start  DATE NOT NULL,
    days          INT NOT NULL CHECK (days BETWEEN 1 AND 31),
    care_level    TEXT NOT NULL,
    amount_cents  BIGINT NOT NULL CHECK (amount_cents > 0),
    status        TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'paid', 'voided')),
    envelope_id   UUID NOT NULL,
    -- Which replica ran the handler (the harness passes CRAIG_REPLICA; NULL elsewhere).
    replica       TEXT,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX idx_payments_envelope ON payments (envelope_id);
CREATE INDEX idx_payments_placement ON payments (placement_id, period_start);
