-- `q` folding (docs/decisions.md, `q`; foldSearch in src/audit/record.ts):
-- search_text is now in NFKC, lower case after it, and holds a word-final `ς`
-- as `σ`, as q does, so `Chloe` + U+0301 finds `Chloé`, `ａｄａ` finds `Ada`
-- and `ΣΊΣΥΦΟΣ` finds `Σίσυφος`. Rows written before hold the gateway's
-- lower case of the fields; they are refolded here (lower() after NFKC only
-- meets what NFKC made of characters without a lower case, such as `ℌ` or
-- `™`), and only rows that change are rewritten. The rewrite is only of this
-- derived column, with the append-only guard lifted inside the migration's
-- transaction only (as in 0005). chr() rather than Greek literals keeps this
-- file ASCII; normalize() needs a UTF8 database, and one in another encoding
-- (which cannot hold most of these characters) is left as it is.
ALTER TABLE "audit_events" DISABLE TRIGGER "audit_events_no_update";--> statement-breakpoint
DO $$
BEGIN
  IF current_setting('server_encoding') = 'UTF8' THEN
    UPDATE "audit_events"
       SET "search_text" = replace(normalize(lower(normalize("search_text", NFKC)), NFKC), chr(962), chr(963))
     WHERE "search_text" IS NOT NFKC NORMALIZED OR strpos("search_text", chr(962)) > 0;
  END IF;
END $$;--> statement-breakpoint
ALTER TABLE "audit_events" ENABLE TRIGGER "audit_events_no_update";
