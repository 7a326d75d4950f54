-- `q` folding (docs/decisions.md, `q`): search_text now holds a word-final `ς`
-- as `σ`, as q does, so `ΣΊΣΥΦΟΣ` finds `Σίσυφος`. Rows written before are
-- refolded here: the rewrite is only of this derived column, with the
-- append-only guard lifted inside the migration's transaction only (as in
-- 0005), and only of rows that change. chr() rather than Greek literals keeps
-- this file ASCII; a database not in UTF8 (which cannot hold Greek text) is
-- left as it is, since chr(962) fails there.
ALTER TABLE "audit_events" DISABLE TRIGGER "audit_events_no_update";--> statement-breakpoint
DO $$
BEGIN
  IF current_setting('server_encoding') = 'UTF8' THEN
    UPDATE "audit_events" SET "search_text" = replace("search_text", chr(962), chr(963))
     WHERE strpos("search_text", chr(962)) > 0;
  END IF;
END $$;--> statement-breakpoint
ALTER TABLE "audit_events" ENABLE TRIGGER "audit_events_no_update";
