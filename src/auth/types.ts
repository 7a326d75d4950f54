import type { QuotaPeriod } from "../db/schema.ts";
import type { RelayTransform } from "../lib/relay-transform.ts";

/**
 * What every layer knows about an authenticated request, with no HTTP in it:
 * who calls (the principal, read by auth/key-row.ts, cached by
 * auth/verify.ts), from where (the caller, for security audit rows), and
 * what a service needs of the request it serves.
 */

export interface Principal {
  keyId: string;
  orgId: string;
  userId: string | null;
  kind: "personal" | "service";
  scopes: readonly string[];
  /** Aliases the key may address; null = all. */
  models: readonly string[] | null;
  expiresAt: Date | null;
  revokedAt: Date | null;
  academyOnly: boolean;
  plan: string;
  /** The organisation's token quota (null = none) and its period; cached with the key. */
  quotaTokens: number | null;
  quotaPeriod: QuotaPeriod;
  /**
   * When the row was read (performance.now() as the lookup was sent): a principal
   * read earlier carries an older quota setting, and is admitted under the newest
   * one seen, not its own (src/limits/quota.ts). Absent: ordered after every other.
   */
  readAt?: number;
  /** Who acts with this key, for audit events: the user of a personal key, the key's name for a service key. */
  actorName: string;
  actorEmail: string;
  /**
   * The first key of this key's rotation lineage (itself when never rotated):
   * a service key's stored responses belong to the lineage, so a rotated key
   * keeps reading them.
   */
  keyRoot: string;
  /**
   * Why the key's row cannot be trusted (an inconsistent kind or owner, see
   * principalOfRow): the key is refused, whatever else the row says.
   */
  damaged?: string;
}

/** The client presenting a key: read only when a rejected key is audited or a lookup is charged. */
export interface Caller {
  readonly ip: string | null;
  readonly userAgent: string | null;
}

/** What a service needs of the request it serves. */
export interface RequestMeta {
  /** Aborted when the client goes away. */
  signal: AbortSignal;
  /** The request id (x-request-id), for log lines. */
  requestId: string;
  /** A streamed answer's events rewritten inside the relay (the Responses API); none for chat. */
  transform?: RelayTransform;
  /** A streamed answer is complete: called just before its response closes (the route gives the connection its idle timeout back). */
  beforeClose?: () => void;
}
