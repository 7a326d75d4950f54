-- `q` folding (docs/decisions.md, `q`; foldSearch in src/audit/record.ts):
-- search_text is now in NFKC, lower case after it, and holds a word-final `ς`
-- as `σ`, as q does, so `Chloe` + U+0301 finds `Chloé`, `ａｄａ` finds `Ada`
-- and `ΣΊΣΥΦΟΣ` finds `Σίσυφος`. Rows written before are refolded from their
-- fields (as 0005 joined them), not from their old search_text: rows 0005
-- rewrote hold the database's lower(), which on an LC_CTYPE of C lowers A to
-- Z only (`Émile` stayed `Émile`, and q=Émile found nothing) and elsewhere
-- lowers `İ` to `i` where JavaScript writes `i` + U+0307. Lower case is ICU's
-- (the und-x-icu collation), which is JavaScript's (Bun's is ICU's); a
-- Postgres built without ICU uses its own lower(). Only rows that change are
-- rewritten. The rewrite is only of this derived column, with the append-only
-- guard lifted inside the migration's transaction only (as in 0005). chr()
-- rather than Greek literals keeps this file ASCII; normalize() needs a UTF8
-- database, and one in another encoding (which cannot hold most of these
-- characters) is left as it is.
ALTER TABLE "audit_events" DISABLE TRIGGER "audit_events_no_update";--> statement-breakpoint
DO $$
BEGIN
  IF current_setting('server_encoding') = 'UTF8' THEN
    EXECUTE format($f$
      UPDATE "audit_events" AS e SET "search_text" = r.folded
        FROM (SELECT "id", replace(normalize(lower(normalize(concat_ws(E'\n',
                nullif("action", ''), nullif("actor_name", ''), nullif("actor_email", ''),
                (SELECT string_agg(f, E'\n' ORDER BY n, k)
                   FROM jsonb_array_elements("targets") WITH ORDINALITY AS t(target, n),
                        LATERAL (VALUES (1, nullif(target->>'name', '')), (2, nullif(target->>'email', ''))) AS v(k, f)
                  WHERE f IS NOT NULL)), NFKC) %s), NFKC), chr(962), chr(963)) AS folded
                FROM "audit_events") AS r
       WHERE e."id" = r."id" AND e."search_text" IS DISTINCT FROM r.folded$f$,
      CASE WHEN EXISTS (SELECT 1 FROM pg_collation WHERE collname = 'und-x-icu') THEN 'COLLATE "und-x-icu"' ELSE '' END);
  END IF;
END $$;--> statement-breakpoint
ALTER TABLE "audit_events" ENABLE TRIGGER "audit_events_no_update";
