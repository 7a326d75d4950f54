-- Every key expires: a key made without an expiry gets created_at + 365 days
-- (the default keys.defaultLifetime), but never less than 30 days from the
-- upgrade, so an upgrade does not cut off keys in use without warning; then
-- the column may not be null.
UPDATE "api_keys" SET "expires_at" = greatest("created_at" + interval '365 days', now() + interval '30 days') WHERE "expires_at" IS NULL;--> statement-breakpoint
ALTER TABLE "api_keys" ALTER COLUMN "expires_at" SET NOT NULL;--> statement-breakpoint
-- `q` matches within one field: search_text now holds one field per line
-- (action, actor name, actor e-mail, each target's name and e-mail; empty ones
-- left out), where it held them joined by spaces. This derived column is the
-- only thing ever rewritten in the append-only log, with its guard lifted
-- inside the migration's transaction only.
ALTER TABLE "audit_events" DISABLE TRIGGER "audit_events_no_update";--> statement-breakpoint
UPDATE "audit_events" SET "search_text" = lower(concat_ws(E'\n',
  nullif("action", ''), nullif("actor_name", ''), nullif("actor_email", ''),
  (SELECT string_agg(f, E'\n' ORDER BY n, k)
     FROM jsonb_array_elements("targets") WITH ORDINALITY AS t(target, n),
          LATERAL (VALUES (1, nullif(target->>'name', '')), (2, nullif(target->>'email', ''))) AS v(k, f)
    WHERE f IS NOT NULL)));--> statement-breakpoint
ALTER TABLE "audit_events" ENABLE TRIGGER "audit_events_no_update";
