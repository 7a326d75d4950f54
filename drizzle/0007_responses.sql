CREATE TABLE "responses" (
	"id" text PRIMARY KEY NOT NULL,
	"org_id" uuid NOT NULL,
	"owner_user_id" uuid,
	"owner_key_id" uuid,
	"previous_response_id" text,
	"input_items" text NOT NULL,
	"response" text NOT NULL,
	"created_at" timestamp (3) with time zone DEFAULT now() NOT NULL,
	"expires_at" timestamp (3) with time zone NOT NULL
);
--> statement-breakpoint
ALTER TABLE "responses" ADD CONSTRAINT "responses_org_id_organizations_id_fk" FOREIGN KEY ("org_id") REFERENCES "public"."organizations"("id") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
CREATE INDEX "responses_expires_idx" ON "responses" USING btree ("expires_at");