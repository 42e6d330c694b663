-- ADR-022 §D1 transactional outbox, §D2 idempotent inbox, §D5 idempotency responses.
-- idempotency_responses is the as-built shape: the base migration plus the platform-stab-2
-- §D1 atomic-claim migration (20260505151229), folded into one here because this reference
-- implementation starts at the as-built schema.
--
-- Retention (ADR-022 § Retention policy, corrected by #965/#1129, ADR-058): event_outbox keeps
-- PUBLISHED rows 30 days (windowed on created_at); PENDING rows are retained indefinitely.
-- event_inbox keeps 31 days (strictly more than the outbox). idempotency_responses: 24 h TTL.

CREATE TABLE event_outbox (
    id              UUID PRIMARY KEY DEFAULT uuidv7(),
    aggregate_id    UUID,
    event_type      TEXT NOT NULL,
    envelope        JSONB NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    published_at    TIMESTAMPTZ,
    attempts        INT NOT NULL DEFAULT 0,
    last_error      TEXT,
    CONSTRAINT event_outbox_published_check
        CHECK (published_at IS NULL OR published_at >= created_at)
);
CREATE INDEX idx_event_outbox_pending
    ON event_outbox (created_at)
    WHERE published_at IS NULL;

CREATE TABLE event_inbox (
    envelope_id     UUID PRIMARY KEY,
    source_service  TEXT NOT NULL,
    event_type      TEXT NOT NULL,
    received_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    processed_at    TIMESTAMPTZ
);
CREATE INDEX idx_event_inbox_received ON event_inbox (received_at);

CREATE TABLE idempotency_responses (
    cache_key        TEXT PRIMARY KEY,
    method           TEXT NOT NULL,
    path             TEXT NOT NULL,          -- descriptive only; lookups key on cache_key
    user_sub         UUID NOT NULL,
    body_fingerprint TEXT,                   -- nullable until finalize
    status           TEXT NOT NULL DEFAULT 'succeeded'
        CHECK (status IN ('processing', 'succeeded', 'failed')),
    status_code      SMALLINT,               -- nullable until finalize
    headers          JSONB,                  -- nullable until finalize
    body             BYTEA,
    body_too_large   BOOLEAN NOT NULL DEFAULT false,
    started_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at      TIMESTAMPTZ,
    claim_expires_at TIMESTAMPTZ NOT NULL DEFAULT now() + INTERVAL '30 seconds',
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at       TIMESTAMPTZ NOT NULL DEFAULT now() + INTERVAL '24 hours'
);
CREATE INDEX idx_idempotency_expires ON idempotency_responses (expires_at);
CREATE INDEX idx_idempotency_responses_processing
    ON idempotency_responses (claim_expires_at) WHERE status = 'processing';
