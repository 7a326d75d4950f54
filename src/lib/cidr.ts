import { isIPv4, isIPv6 } from "node:net";

/** The 32 or 128 bits of an address that node:net accepted (`::` and a dotted IPv4 tail expanded). */
function addressBits(addr: string): boolean[] {
  if (isIPv4(addr)) return addr.split(".").flatMap((o) => bitsOf(Number(o), 8));
  let text = addr;
  const dotted = /(\d+)\.(\d+)\.(\d+)\.(\d+)$/.exec(text);
  if (dotted) {
    const [a, b, c, d] = dotted.slice(1).map(Number) as [number, number, number, number];
    text = `${text.slice(0, dotted.index)}${((a << 8) | b).toString(16)}:${((c << 8) | d).toString(16)}`;
  }
  const [head = "", tail] = text.split("::");
  const h = head ? head.split(":") : [];
  const t = tail ? tail.split(":") : [];
  const zeros: string[] = tail === undefined ? [] : Array(8 - h.length - t.length).fill("0");
  return [...h, ...zeros, ...t].flatMap((g) => bitsOf(Number.parseInt(g, 16), 16));
}

function bitsOf(n: number, width: number): boolean[] {
  return [...n.toString(2).padStart(width, "0")].map((b) => b === "1");
}

/**
 * Why `s` is not a network prefix in CIDR notation (spec 2.6 `origin.ip_prefix`),
 * or null when it is one: an IPv4 or IPv6 address, then a prefix length shorter
 * than the address (a /32 or /128 is a full address), and no host bits set.
 */
export function networkPrefixProblem(s: string): string | null {
  const m = /^([0-9A-Fa-f.:]{2,45})\/(\d{1,3})$/.exec(s);
  if (!m?.[1] || !m[2]) return "is not in CIDR notation (address/length), e.g. 203.0.113.0/24";
  const [, addr, lenText] = m;
  if (!isIPv4(addr) && !isIPv6(addr)) return "does not start with an IPv4 or IPv6 address";
  const bits = addressBits(addr);
  const len = Number(lenText);
  if (len >= bits.length) return `is a full address (/${len}), not a network prefix`;
  if (bits.slice(len).some(Boolean)) return `has host bits set beyond /${len}`;
  return null;
}
