CREATE TABLE "usage_dead_letters" (
	"id" bigserial PRIMARY KEY NOT NULL,
	"created_at" timestamp (3) with time zone DEFAULT now() NOT NULL,
	"record" text NOT NULL,
	"error" text NOT NULL
);
--> statement-breakpoint
ALTER TABLE "usage_counters" ADD COLUMN "wanted_at" timestamp (3) with time zone;