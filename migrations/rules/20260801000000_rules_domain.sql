-- rules service domain table. Deliberately NO unique key: only the inbox (ADR-022 §D2)
-- protects it from a redelivered envelope, which is what the effect_once checker measures.
CREATE TABLE rule_evaluations (
    id            UUID PRIMARY KEY DEFAULT uuidv7(),
    envelope_id   UUID NOT NULL,
    referral_id   UUID,
    rule          TEXT NOT NULL,
    outcome       TEXT NOT NULL,
    evaluated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX idx_rule_evaluations_envelope ON rule_evaluations (envelope_id);
