import { promises as dns } from "node:dns";
import { AppError } from "../lib/errors.ts";
import { isRecord } from "../lib/guards.ts";
import type { ChatMessage } from "./model.ts";

/**
 * Image URLs are fetched by the inference server, inside the operator's
 * network: a customer must not make it fetch loopback, private, link-local,
 * unique-local, CGNAT or cloud-metadata addresses. Refused (400, `param` = the
 * part's url) unless the operator allows them (`upstream.imageUrls`).
 *
 *  - The URL is parsed as WHATWG does, which reads every IPv4 spelling
 *    (`2130706433`, `0x7f.1`, `0177.0.0.1`, `127.1`, trailing dot) as the
 *    dotted quad; IPv6 literals are read whole, with the IPv4 address inside
 *    IPv4-mapped, -compatible, NAT64 and 6to4 forms checked as IPv4.
 *  - The upstream is sent the canonical form we checked (`url.href`), so a
 *    parser on the inference server that reads the raw text differently
 *    (backslashes, userinfo tricks) cannot be pointed elsewhere; URLs with
 *    userinfo, backslashes, spaces or control characters are refused outright.
 *  - Names are resolved (all addresses, bounded time, at most MAX_HOSTS per
 *    request) and refused if any address is internal. A name that does not
 *    resolve here is refused too: the inference server may resolve it on an
 *    internal DNS (`metadata.google.internal`). `localhost` and `*.localhost`
 *    are refused without a lookup.
 *
 * What remains: a name whose DNS answer changes between our lookup and the
 * upstream's (rebinding). Egress filtering on the inference servers closes that.
 */

export type HostLookup = (host: string) => Promise<string[]>;

export interface ImageUrlPolicy {
  /** Accept every host (the operator's network has nothing to protect, or filters egress itself). */
  allowPrivate: boolean;
  /** Host names (exact) and addresses or CIDRs accepted even though internal. */
  allow: readonly string[];
  /** Deadline for resolving a request's image hosts. */
  resolveTimeoutMs: number;
}

export const DEFAULT_IMAGE_URL_POLICY: ImageUrlPolicy = { allowPrivate: false, allow: [], resolveTimeoutMs: 2_000 };

/** Distinct host names resolved for one request; more is refused (a body can hold thousands of parts). */
export const MAX_HOSTS = 16;
/**
 * Lookups in flight across all requests, counted until the resolver returns
 * (a lookup we stopped waiting for still holds a resolver thread). Beyond
 * it, image hosts are not resolved: 429 with retry-after, so names whose DNS
 * never answers cannot starve the resolver the upstream connections need.
 */
export const MAX_LOOKUPS_IN_FLIGHT = 64;

export const systemLookup: HostLookup = async (host) => (await dns.lookup(host, { all: true, verbatim: true })).map((a) => a.address);

// ---------------------------------------------------------------------------
// Addresses as 16 bytes (IPv4 as ::ffff:a.b.c.d) and CIDR ranges over them
// ---------------------------------------------------------------------------

type Addr = Uint8Array;
interface Net {
  addr: Addr;
  bits: number;
}

function parseV4(s: string): Addr | undefined {
  const m = /^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})$/.exec(s);
  if (!m) return undefined;
  const out = new Uint8Array(16);
  out[10] = 0xff;
  out[11] = 0xff;
  for (let i = 0; i < 4; i++) {
    const n = Number(m[i + 1]);
    if (n > 255) return undefined;
    out[12 + i] = n;
  }
  return out;
}

function parseV6(text: string): Addr | undefined {
  let s = text;
  const zone = s.indexOf("%");
  if (zone !== -1) s = s.slice(0, zone);
  const words: number[] = [];
  let gap = -1;
  const halves = s.split("::");
  if (halves.length > 2) return undefined;
  const groups = (h: string): string[] | undefined => (h === "" ? [] : h.split(":"));
  const parts: (string[] | undefined)[] = halves.map(groups);
  for (const [hi, part] of parts.entries()) {
    if (!part) return undefined;
    if (hi === 1) gap = words.length;
    for (const [gi, g] of part.entries()) {
      const last = hi === parts.length - 1 && gi === part.length - 1;
      if (last && g.includes(".")) {
        const v4 = parseV4(g);
        if (!v4) return undefined;
        words.push(((v4[12] ?? 0) << 8) | (v4[13] ?? 0), ((v4[14] ?? 0) << 8) | (v4[15] ?? 0));
      } else {
        if (!/^[0-9a-fA-F]{1,4}$/.test(g)) return undefined;
        words.push(Number.parseInt(g, 16));
      }
    }
  }
  if (gap === -1 ? words.length !== 8 : words.length > 7) return undefined;
  const full = gap === -1 ? words : [...words.slice(0, gap), ...new Array<number>(8 - words.length).fill(0), ...words.slice(gap)];
  const out = new Uint8Array(16);
  for (const [i, w] of full.entries()) {
    out[2 * i] = w >> 8;
    out[2 * i + 1] = w & 0xff;
  }
  return out;
}

/** An IPv4 or IPv6 address in text form (brackets allowed), or undefined for a name. */
export function parseIp(text: string): Addr | undefined {
  const s = text.startsWith("[") && text.endsWith("]") ? text.slice(1, -1) : text;
  return s.includes(":") ? parseV6(s) : parseV4(s);
}

function parseNet(text: string): Net | undefined {
  const slash = text.indexOf("/");
  const addr = parseIp(slash === -1 ? text : text.slice(0, slash));
  if (!addr) return undefined;
  const v4 = !text.slice(0, slash === -1 ? undefined : slash).includes(":");
  const max = v4 ? 32 : 128;
  const bits = slash === -1 ? max : Number(text.slice(slash + 1));
  if (!Number.isInteger(bits) || bits < 0 || bits > max || !/^\d+$/.test(slash === -1 ? "0" : text.slice(slash + 1))) return undefined;
  return { addr, bits: v4 ? bits + 96 : bits };
}

function inNet(a: Addr, n: Net): boolean {
  let bits = n.bits;
  for (let i = 0; bits > 0; i++, bits -= 8) {
    const mask = bits >= 8 ? 0xff : (0xff << (8 - bits)) & 0xff;
    if (((a[i] ?? 0) & mask) !== ((n.addr[i] ?? 0) & mask)) return false;
  }
  return true;
}

const net = (s: string): Net => {
  const n = parseNet(s);
  if (!n) throw new Error(`bad built-in range ${s}`);
  return n;
};

/** Addresses an image URL may not name. IPv4 ranges also cover their IPv6 embeddings (see `embeddedV4`). */
const BLOCKED: readonly Net[] = [
  "0.0.0.0/8", // "this network"; 0.0.0.0 reaches the local host on Linux
  "10.0.0.0/8",
  "100.64.0.0/10", // CGNAT (Alibaba's metadata is 100.100.100.200)
  "127.0.0.0/8",
  "169.254.0.0/16", // link-local, cloud metadata 169.254.169.254
  "172.16.0.0/12",
  "192.0.0.0/24", // IETF protocol assignments (Oracle's metadata 192.0.0.192)
  "192.168.0.0/16",
  "198.18.0.0/15", // benchmarking
  "224.0.0.0/4", // multicast
  "240.0.0.0/4", // reserved, broadcast
  "::/128",
  "::1/128",
  "64:ff9b:1::/48", // local-use NAT64
  "100::/64", // discard
  "2001::/32", // Teredo: the client address inside is obfuscated
  "fc00::/7", // unique-local (AWS metadata fd00:ec2::254)
  "fe80::/10", // link-local
  "fec0::/10", // site-local (deprecated)
  "ff00::/8", // multicast
].map(net);

const MAPPED = net("::ffff:0:0/96");
const COMPAT = net("::/96");
const NAT64 = net("64:ff9b::/96");
const SIX_TO_FOUR = net("2002::/16");

/** The IPv4 address an IPv6 address carries (mapped, compatible, NAT64, 6to4), as ::ffff:a.b.c.d. */
function embeddedV4(a: Addr): Addr | undefined {
  let at: number;
  if (inNet(a, MAPPED)) return undefined; // already the IPv4 form
  if (inNet(a, COMPAT) || inNet(a, NAT64)) at = 12;
  else if (inNet(a, SIX_TO_FOUR)) at = 2;
  else return undefined;
  const out = new Uint8Array(16);
  out[10] = 0xff;
  out[11] = 0xff;
  out.set(a.subarray(at, at + 4), 12);
  return out;
}

function isInternal(a: Addr, allowed: readonly Net[]): boolean {
  if (allowed.some((n) => inNet(a, n))) return false;
  if (BLOCKED.some((n) => inNet(a, n))) return true;
  const v4 = embeddedV4(a);
  return v4 !== undefined && isInternal(v4, allowed);
}

// ---------------------------------------------------------------------------
// The check
// ---------------------------------------------------------------------------

/** Problems with the operator's allow list, for config loading. */
export function allowListProblems(allow: readonly string[]): string[] {
  const bad: string[] = [];
  for (const [i, e] of allow.entries()) {
    const looksLikeAddress = e.includes("/") || e.includes(":") || /^[\d.]+$/.test(e);
    if (looksLikeAddress ? !parseNet(e) : !/^[a-z0-9]([a-z0-9.-]*[a-z0-9])?\.?$/i.test(e)) {
      bad.push(`/upstream/imageUrls/allow/${i}: not a host name, an address or a CIDR (got ${JSON.stringify(e)})`);
    }
  }
  return bad;
}

// biome-ignore lint/suspicious/noControlCharactersInRegex: matching control characters is this pattern's job.
const UNSAFE_CHARS = /[\\\s\u0000-\u001f\u007f]/;

/**
 * `s` without its trailing dots (a fully qualified name's root). Not
 * `replace(/\.+$/, "")`: that tries every run of dots to the end, n²/2 steps
 * on a host of n dots followed by a letter (a request's URL can hold millions).
 */
function withoutTrailingDots(s: string): string {
  let end = s.length;
  while (end > 0 && s.charCodeAt(end - 1) === 46) end--;
  return end === s.length ? s : s.slice(0, end);
}

interface Pending {
  name: string;
  param: string;
}

function refuse(param: string, message: string): AppError {
  return new AppError("invalid_request_error", message, param);
}

/**
 * Returns a checker for a request's messages. It throws AppError for a URL it
 * can judge at once, returns a promise when names must be resolved, and
 * returns undefined (no promise, no allocation) when there is nothing to
 * check: requests without image URLs stay off this path. Accepted URLs are
 * rewritten in place to the canonical form that was checked.
 */
export function createImageUrlCheck(given: Partial<ImageUrlPolicy>, lookup: HostLookup = systemLookup) {
  const policy: ImageUrlPolicy = { ...DEFAULT_IMAGE_URL_POLICY, ...given };
  const nets: Net[] = [];
  const names = new Set<string>();
  for (const e of policy.allow) {
    const n = parseNet(e);
    if (n) nets.push(n);
    else names.add(withoutTrailingDots(e.toLowerCase()));
  }

  let inFlight = 0;

  async function resolveAll(pending: Pending[]): Promise<void> {
    const hosts = pending.map((p) => p.name);
    if (inFlight + hosts.length > MAX_LOOKUPS_IN_FLIGHT) {
      throw new AppError("rate_limit_error", "Too many image hosts are being resolved at the moment; retry after 1 s.", null, { "retry-after": "1" });
    }
    inFlight += hosts.length;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const deadline = new Promise<"timeout">((resolve) => {
      timer = setTimeout(() => resolve("timeout"), policy.resolveTimeoutMs);
    });
    try {
      const answers = new Map<string, string[] | "timeout" | "failed">();
      await Promise.all(
        hosts.map(async (h) => {
          // Promise.resolve().then: a resolver that throws synchronously is a failed lookup too, never a 500.
          const looked = Promise.resolve()
            .then(() => lookup(h))
            .catch(() => "failed" as const)
            .finally(() => inFlight--);
          const r = await Promise.race([looked, deadline]);
          answers.set(h, r);
        }),
      );
      for (const p of pending) {
        const r = answers.get(p.name);
        if (r === "timeout") throw refuse(p.param, `The image host '${p.name}' could not be resolved within ${policy.resolveTimeoutMs} ms.`);
        if (r === undefined || r === "failed" || r.length === 0) throw refuse(p.param, `The image host '${p.name}' does not resolve.`);
        for (const address of r) {
          const a = parseIp(address);
          if (!a || isInternal(a, nets)) {
            throw refuse(p.param, `The image host '${p.name}' resolves to an internal address; image URLs must name public hosts.`);
          }
        }
      }
    } finally {
      clearTimeout(timer);
    }
  }

  return function check(messages: readonly ChatMessage[]): Promise<void> | undefined {
    if (policy.allowPrivate) return undefined;
    let pending: Pending[] | undefined;
    let distinct: Set<string> | undefined;
    // Indexed loops: entries() made an iterator and a pair per message on every request.
    for (let i = 0; i < messages.length; i++) {
      const m = messages[i] as ChatMessage;
      if (m.role !== "user" || !Array.isArray(m.content)) continue;
      for (let j = 0; j < m.content.length; j++) {
        const part = m.content[j] as (typeof m.content)[number];
        // Parts were validated (model.ts): an image_url part holds { url: string }.
        const image = part.type === "image_url" ? (part as { image_url?: unknown }).image_url : undefined;
        if (!isRecord(image) || typeof image.url !== "string") continue;
        const raw = image.url;
        if (raw.startsWith("data:")) continue;
        const param = `messages[${i}].content[${j}].image_url.url`;
        let url: URL;
        try {
          if (UNSAFE_CHARS.test(raw)) throw new Error("unsafe characters");
          url = new URL(raw);
        } catch {
          throw refuse(param, "The image URL is not a well-formed http(s) URL.");
        }
        if (url.username !== "" || url.password !== "") throw refuse(param, "Image URLs may not carry credentials (user:password@).");
        image.url = url.href;
        const host = url.hostname;
        const literal = parseIp(host);
        if (literal) {
          if (isInternal(literal, nets)) throw refuse(param, `The image URL names an internal address (${host}); image URLs must name public hosts.`);
          continue;
        }
        const name = withoutTrailingDots(host.toLowerCase());
        if (names.has(name)) continue;
        if (name === "localhost" || name.endsWith(".localhost")) throw refuse(param, `The image URL names the host '${name}'; image URLs must name public hosts.`);
        pending ??= [];
        distinct ??= new Set();
        if (!distinct.has(name)) {
          if (distinct.size >= MAX_HOSTS) throw refuse(param, `Image URLs of one request may name at most ${MAX_HOSTS} different hosts.`);
          distinct.add(name);
          pending.push({ name, param });
        }
      }
    }
    return pending ? resolveAll(pending) : undefined;
  };
}

export type ImageUrlCheck = ReturnType<typeof createImageUrlCheck>;
