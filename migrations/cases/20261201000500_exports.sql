-- `POST /v1/cases/exports?size=N` (CONTRACT § fleet): each execution of the handler records
-- the idempotency key and cache key it ran under, the claim generation it won and the
-- sha256 of the body it produced: what the harness's sentinel_integrity checker counts
-- (§D5, #1183).
ALTER TABLE exports
    ADD COLUMN idempotency_key TEXT,
    ADD COLUMN cache_key       TEXT,
    ADD COLUMN generation      BIGINT,
    ADD COLUMN replica         TEXT,
    ADD COLUMN body_sha256     TEXT;
CREATE INDEX idx_exports_key ON exports (idempotency_key);
