/**
 * Opaque, tamper-evident keyset cursor for audit-log pagination.
 *
 * Token: base64url(payload) "." base64url(HMAC-SHA256(...)[0..16]).
 * - Opaque so clients cannot build positions by hand and we can change the
 *   format (the payload carries a version).
 * - MAC'd so a client cannot point the keyset query at arbitrary positions.
 * - Bound to `binding` (org id + canonical filter string): a cursor minted for
 *   one org or filter set is rejected for any other, so it cannot be replayed
 *   across tenants or used to skip filter checks.
 * The position itself is not secret (it is a row's timestamp and id), so it is
 * only encoded, not encrypted.
 */

import { createHmac, timingSafeEqual } from "node:crypto";
import { isUuid } from "../lib/ids.ts";
import { parseInstant } from "../lib/time.ts";

export interface CursorPosition {
  /** Row timestamp exactly as stored/selected (ms or µs precision). */
  createdAt: string;
  /** Row uuid. */
  id: string;
}

const VERSION = "1";
/** 128-bit tag: forging needs ~2^128 guesses; keeps tokens short. */
const TAG_BYTES = 16;
const TAG_CHARS = 22; // base64url length of 16 bytes, unpadded
/** Far above any valid token (~120 chars); rejects junk before any work. */
const MAX_TOKEN_CHARS = 256;
/** Domain separation: this key may one day MAC other things too. */
const DOMAIN = "gateway/audit-cursor/v1\n";

const B64URL_RE = /^[A-Za-z0-9_-]+$/;
/** Position 10 of Postgres' timestamptz text ("2024-05-01 12:00:00.123456+00") holds a space where ISO has T. */
const PG_SEPARATOR = 10;

/**
 * A row time outside years 0001–9999 as search.ts reads it for the cursor:
 * `infinity`, `-infinity`, or UTC text with a four- to six-digit year,
 * microseconds and the era, which Postgres reads back exactly.
 */
const ODD_TIME = /^(?:-?infinity|\d{4,6}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])T(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d\.\d{6}Z (?:AD|BC))$/;

/**
 * A row's timestamp as stored and printed: Date#toISOString or Postgres'
 * timestamptz text, in the one time grammar (src/lib/time.ts) with the seconds
 * given and at most microseconds, what Postgres keeps; or a time outside
 * years 0001–9999 (ODD_TIME).
 */
function isValidTimestamp(s: string): boolean {
  if (ODD_TIME.test(s)) return true;
  const iso = s.charAt(PG_SEPARATOR) === " " ? `${s.slice(0, PG_SEPARATOR)}T${s.slice(PG_SEPARATOR + 1)}` : s;
  const t = parseInstant(iso);
  return t?.seconds === true && t.fractionDigits <= 6;
}

function isValidPosition(pos: CursorPosition): boolean {
  return typeof pos.createdAt === "string" && typeof pos.id === "string" && isUuid(pos.id) && isValidTimestamp(pos.createdAt);
}

function tag(payloadB64: string, binding: string, secret: Uint8Array | string): string {
  // Length-prefix the binding so (binding, payload) pairs cannot be shifted
  // into one another; the MAC covers the payload *text*, so every character of
  // the token matters (no non-canonical base64 variants of the same bytes).
  const mac = createHmac("sha256", secret);
  mac.update(DOMAIN);
  mac.update(`${Buffer.byteLength(binding, "utf8")}:`);
  mac.update(binding, "utf8");
  mac.update(payloadB64);
  return mac.digest().subarray(0, TAG_BYTES).toString("base64url");
}

function secretUsable(secret: Uint8Array | string): boolean {
  return typeof secret === "string" ? secret.length > 0 : secret instanceof Uint8Array && secret.byteLength > 0;
}

/** Throws TypeError on an invalid position or empty secret (programming errors). */
export function encodeCursor(pos: CursorPosition, binding: string, secret: Uint8Array | string): string {
  if (!isValidPosition(pos)) throw new TypeError("encodeCursor: invalid position (need ISO timestamp and uuid)");
  if (!secretUsable(secret)) throw new TypeError("encodeCursor: empty secret");
  const payload = Buffer.from(`${VERSION}|${pos.createdAt}|${pos.id}`, "utf8").toString("base64url");
  return `${payload}.${tag(payload, binding, secret)}`;
}

/**
 * The position, or null for anything not minted by `encodeCursor` with this
 * binding and secret: tampered, truncated, wrong binding/secret, malformed,
 * over-long or non-string input. Never throws, so a route can map null to 400.
 */
export function decodeCursor(token: string, binding: string, secret: Uint8Array | string): CursorPosition | null {
  try {
    if (typeof token !== "string" || token.length === 0 || token.length > MAX_TOKEN_CHARS) return null;
    if (typeof binding !== "string" || !secretUsable(secret)) return null;
    const dot = token.indexOf(".");
    if (dot <= 0 || dot !== token.lastIndexOf(".")) return null;
    const payload = token.slice(0, dot);
    const got = token.slice(dot + 1);
    if (got.length !== TAG_CHARS || !B64URL_RE.test(payload) || !B64URL_RE.test(got)) return null;

    // Compare the tag texts in constant time (equal lengths checked above), so
    // timing reveals nothing about how many leading characters were right.
    const want = tag(payload, binding, secret);
    if (!timingSafeEqual(Buffer.from(got, "latin1"), Buffer.from(want, "latin1"))) return null;

    // Authentic, but still validate strictly: defence in depth against a leaked
    // secret or a future format mixed up with this one.
    const parts = Buffer.from(payload, "base64url").toString("utf8").split("|");
    if (parts.length !== 3 || parts[0] !== VERSION) return null;
    const pos: CursorPosition = { createdAt: parts[1] ?? "", id: parts[2] ?? "" };
    return isValidPosition(pos) ? pos : null;
  } catch {
    return null;
  }
}
