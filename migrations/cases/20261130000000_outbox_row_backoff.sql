-- ADR-022 #1128 "no throughput ceiling", hardened: a row the broker refuses (returned as
-- unroutable, Nacked) or that is not a valid envelope backs off ON ITS OWN, so the drain
-- goes on past it and only broker-wide failures back the whole worker off. The row stays
-- pending (published_at NULL) with attempts and last_error: it is never stamped as
-- published and never deleted. NULL means "claimable now".
ALTER TABLE event_outbox ADD COLUMN next_attempt_at TIMESTAMPTZ;
