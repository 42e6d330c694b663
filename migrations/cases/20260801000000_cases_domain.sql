-- cases service domain tables (CONTRACT § fleet): the side effects a checker counts.
CREATE TABLE referrals (
    id          UUID PRIMARY KEY DEFAULT uuidv7(),
    subject     TEXT NOT NULL,
    created_by  UUID NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE placements (
    id            UUID PRIMARY KEY DEFAULT uuidv7(),
    referral_id   UUID REFERENCES referrals (id),
    status        TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'active')),
    activated_at  TIMESTAMPTZ,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- One row per EXECUTION of POST /v1/cases/exports (the over-cap / sentinel path).
CREATE TABLE exports (
    id          UUID PRIMARY KEY DEFAULT uuidv7(),
    size_bytes  BIGINT NOT NULL,
    created_by  UUID NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
