-- btree_gin lets org_id sit inside the trigram GIN index, so a `q` search reads
-- one organisation's postings instead of every organisation's.
CREATE EXTENSION IF NOT EXISTS btree_gin;--> statement-breakpoint
CREATE INDEX "audit_org_search_trgm_idx" ON "audit_events" USING gin ("org_id","search_text" gin_trgm_ops);--> statement-breakpoint
DROP INDEX "audit_search_trgm_idx";
