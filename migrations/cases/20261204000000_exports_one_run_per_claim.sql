-- One export per claim generation (§D5, issue 22): the handler writes its row with
-- ON CONFLICT DO NOTHING on (cache_key, generation), so a write whose acknowledgement a
-- connection lost can be sent again to learn its outcome. An INSERT still in flight holds
-- the index entry, so the second waits for it and never makes a second export of one claim.
CREATE UNIQUE INDEX idx_exports_one_per_claim ON exports (cache_key, generation) WHERE cache_key IS NOT NULL;
