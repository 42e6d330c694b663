-- ADR-022 §D5 past the ADR (#1182): the claim generation. Every claim and re-claim of a
-- cache key increments it; every finalize applies only while the row still carries the
-- generation it won, so a stale winner whose claim expired cannot overwrite a re-claimed
-- slot. Schema-compatible: an older replica's writes leave it alone.
ALTER TABLE idempotency_responses ADD COLUMN claim_generation BIGINT NOT NULL DEFAULT 0;
