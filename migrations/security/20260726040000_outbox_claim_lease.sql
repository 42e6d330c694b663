-- ADR-022 Amendment #1128: claim-lease drain. A worker stamps claimed_at in a short claim
-- transaction (FOR UPDATE SKIP LOCKED), publishes with no locks held, then stamps
-- published_at. A claim older than the lease (60 s) is claimable again, so a crash between
-- claim and stamp heals by lease expiry (at-least-once).
ALTER TABLE event_outbox ADD COLUMN claimed_at TIMESTAMPTZ;
