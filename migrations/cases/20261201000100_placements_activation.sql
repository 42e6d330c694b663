-- POST /v1/cases/placements/{id}/activate (CONTRACT § fleet): what was activated, which the
-- placement.activated event carries as immutable facts (ADR-022 #1179: the financial
-- service derives its per-diem payment's natural key from them).
ALTER TABLE placements
    ADD COLUMN care_level   TEXT,
    ADD COLUMN period_start DATE,
    ADD COLUMN days         INT CHECK (days BETWEEN 1 AND 31);
