-- craig-security's audit tables — ADR-022 §D3 (DLQ consumer, threshold alert) with #1181
-- (per-occurrence idempotency), #1156 (exact crossing) and #1197 (no log-and-ack).
-- Both tables are ADR-058 audit-class: append-only, never updated.

-- Every event on craig.events, written by the wildcard (`#`) audit subscriber behind the
-- §D2 inbox. security.dlq.threshold_exceeded lands here too: it is the per-event_type audit
-- record of a burst (§D3, #1199).
CREATE TABLE audit_log (
    id              UUID PRIMARY KEY DEFAULT uuidv7(),
    envelope_id     UUID NOT NULL,
    event_type      TEXT NOT NULL,
    source_service  TEXT NOT NULL,
    aggregate_id    UUID,
    occurred_at     TIMESTAMPTZ NOT NULL,
    envelope        JSONB NOT NULL,
    recorded_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX idx_audit_log_event_type ON audit_log (event_type, recorded_at);
CREATE INDEX idx_audit_log_envelope ON audit_log (envelope_id);

-- One row per dead-lettered occurrence (#1181), or per delivery where no occurrence token
-- could be trusted (tokenless: raw or foreign publishes keep pre-C2 duplicate rows), or per
-- quarantine (malformed bytes; a divergent claim of an existing token).
CREATE TABLE dead_letter_audit (
    id               UUID PRIMARY KEY DEFAULT uuidv7(),
    -- How the row came to be: 'recorded' (tokened occurrence), 'tokenless', 'malformed'
    -- (the body is not an envelope: raw_body is all there is), 'divergent' (a token already
    -- recorded with other immutable facts, re-inserted tokenless: #1181 R7 quarantine).
    disposition      TEXT NOT NULL
        CHECK (disposition IN ('recorded', 'tokenless', 'malformed', 'divergent')),
    path             TEXT NOT NULL CHECK (path IN ('broker', 'app', 'unknown')),
    routing_key      TEXT NOT NULL,
    -- The CONSUMER queue (#1196); historical app-path rows may carry producer keys.
    original_queue   TEXT,
    envelope_id      UUID,
    event_type       TEXT,
    source_service   TEXT,           -- producer provenance only (#1196)
    reason           TEXT,
    envelope         JSONB,
    raw_body         BYTEA NOT NULL, -- the delivery's bytes as received
    occurrence_token TEXT,
    occurred_at      TIMESTAMPTZ,    -- occurrence time when trustworthy (#1181)
    note             TEXT,           -- why tokenless / quarantined
    dlq_received_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT dead_letter_audit_token_len CHECK (octet_length(occurrence_token) <= 256),
    CONSTRAINT dead_letter_audit_tokened
        CHECK ((disposition = 'recorded') = (occurrence_token IS NOT NULL))
);
-- The #1181 arbiter: partial, so NULL (tokenless, historical, quarantined) rows each record.
CREATE UNIQUE INDEX dead_letter_audit_occurrence_token
    ON dead_letter_audit (occurrence_token) WHERE occurrence_token IS NOT NULL;
-- The #1156 window as re-keyed by #1181 R5/R8: occurrence time when known, clamped to receipt.
CREATE INDEX dead_letter_audit_threshold_window
    ON dead_letter_audit (event_type, (LEAST(COALESCE(occurred_at, dlq_received_at), dlq_received_at)));
-- Archive aging stays on receipt (#1181).
CREATE INDEX dead_letter_audit_received ON dead_letter_audit (dlq_received_at);
