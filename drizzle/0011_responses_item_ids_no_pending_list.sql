-- item_reference lookups (src/responses/store.ts, items) probe the GIN index on
-- output_item_ids once per id referenced. With fastupdate (GIN's default), new
-- entries wait in a pending list of up to 4 MB that every probe reads whole
-- until a vacuum merges it; the embedded database has no autovacuum, so there
-- it is merged only when full. 5,000 probes took 14.8 s on the embedded
-- database with a pending list of 100,000 ids, 0.23 s without. Each insert
-- now goes into the index itself: a response adds a few ids, once. The index
-- is not rebuilt; the pending list it has is merged here.
ALTER INDEX "responses_output_item_ids_idx" SET (fastupdate = off);--> statement-breakpoint
SELECT gin_clean_pending_list('responses_output_item_ids_idx'::regclass);
