import { Elysia } from "elysia";
import type { authPlugin } from "../http/auth.ts";
import type { Principal } from "./types.ts";

/** Spec 2.5. Every key expires (README "Decisions"), so `expires_at` is always a timestamp. */
export function keyInfo(p: Principal) {
  // api_keys.expires_at is NOT NULL (migration 0005); a null here is a broken database, not a client error.
  if (!p.expiresAt) throw new Error(`key ${p.keyId} has no expires_at`);
  return {
    key: { id: p.keyId, kind: p.kind, scopes: [...p.scopes], expires_at: p.expiresAt.toISOString() },
    organization: { id: p.orgId, plan: p.plan },
  };
}

/** GET /v1/me: what the presented key is (the App API's ping); any inference key may ask. */
export function meRoutes(auth: ReturnType<typeof authPlugin>) {
  return new Elysia({ name: "me" }).use(auth).get("/v1/me", ({ principal }) => keyInfo(principal), { auth: { scope: "inference" } });
}
