-- ADR-022 Amendment #1185: the partner HTTP send queue. A payment's transmission to the
-- partner is one exchange_transactions row (pending -> sent | failed; failed -> pending is
-- the only legal exit from a terminal status) and one exchange_send_jobs row that workers
-- claim, POST and finalize.
--
-- The #1128 lease, ported: claimed_at is stamped at claim and recovery folds into the
-- claim's WHERE (claimed_at IS NULL OR claimed_at < now() - CLAIM_LEASE), so an expired
-- lease re-admits the row on the ordinary poll. claim_generation is bumped by every claim
-- and fences every terminal and retry transition (AND status = 'in_flight' AND
-- claim_generation = $n). next_attempt_at is scheduled eligibility only: recovery never keys
-- on it (the pre-#1185 defect).
CREATE TABLE exchange_transactions (
    id          UUID PRIMARY KEY DEFAULT uuidv7(),
    payment_id  UUID,
    status      TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'sent', 'failed')),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE exchange_send_jobs (
    id                UUID PRIMARY KEY DEFAULT uuidv7(),
    transaction_id    UUID NOT NULL REFERENCES exchange_transactions (id),
    -- craig_correlation_id, sent with every POST: the partner-side dedup boundary.
    correlation_id    UUID NOT NULL DEFAULT uuidv7(),
    payload           JSONB NOT NULL,
    status            TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'in_flight', 'sent', 'failed')),
    attempts          INT NOT NULL DEFAULT 0,
    next_attempt_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    claimed_at        TIMESTAMPTZ,
    claim_generation  BIGINT NOT NULL DEFAULT 0,
    last_error        TEXT,
    finished_at       TIMESTAMPTZ,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX idx_exchange_send_jobs_due
    ON exchange_send_jobs (next_attempt_at)
    WHERE status IN ('pending', 'in_flight');
CREATE INDEX idx_exchange_send_jobs_transaction ON exchange_send_jobs (transaction_id);
