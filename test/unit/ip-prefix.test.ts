import { describe, expect, test } from "bun:test";
import { ipPrefix } from "../../src/auth/security.ts";

/**
 * The network prefix kept in the audit log and used for the unknown-key
 * budget: /24 for IPv4, /48 for IPv6 in canonical form (RFC 5952), and the
 * IPv4 /24 for an IPv4 address carried in IPv6 (IPv4-mapped ::ffff:0:0/96,
 * and NAT64's well-known 64:ff9b::/96), whether written dotted or in hex.
 */
describe("ipPrefix", () => {
  const cases: [string | null, string][] = [
    ["203.0.113.77", "203.0.113.0/24"],
    ["10.0.0.1", "10.0.0.0/24"],
    // IPv4-mapped, as a dual-stack listener reports IPv4 clients.
    ["::ffff:203.0.113.77", "203.0.113.0/24"],
    ["::FFFF:203.0.113.77", "203.0.113.0/24"],
    ["::ffff:cb00:714d", "203.0.113.0/24"],
    ["0:0:0:0:0:ffff:cb00:714d", "203.0.113.0/24"],
    // NAT64 (RFC 6052 well-known prefix): the client is the embedded IPv4 address.
    ["64:ff9b::203.0.113.77", "203.0.113.0/24"],
    ["64:ff9b::cb00:714d", "203.0.113.0/24"],
    // Plain IPv6: the first 48 bits, zero-compressed.
    ["2001:db8:1234:5678::1", "2001:db8:1234::/48"],
    ["2001:0DB8:0000:5678:0:0:0:1", "2001:db8::/48"],
    ["2001:db8::", "2001:db8::/48"],
    ["2001:0:5::9", "2001:0:5::/48"],
    ["::1", "::/48"],
    ["::", "::/48"],
    ["fe80::1%eth0", "fe80::/48"],
    // Another IPv6 address written with a dotted tail stays IPv6.
    ["2001:db8:1::203.0.113.77", "2001:db8:1::/48"],
    // Not an address: the prefix that says nothing (still CIDR, spec 2.6).
    [null, "0.0.0.0/0"],
    ["", "0.0.0.0/0"],
    ["garbage", "0.0.0.0/0"],
    ["1.2.3", "0.0.0.0/0"],
    ["1.2.3.256", "0.0.0.0/0"],
    ["2001:db8:::1", "0.0.0.0/0"],
    ["12345::", "0.0.0.0/0"],
    ["1:2:3:4:5:6:7:8:9", "0.0.0.0/0"],
    ["1::2::3", "0.0.0.0/0"],
    ["::ffff:1.2.3.4.5", "0.0.0.0/0"],
  ];
  for (const [ip, want] of cases) {
    test(`${JSON.stringify(ip)} → ${JSON.stringify(want)}`, () => {
      expect(ipPrefix(ip)).toBe(want);
    });
  }
});
