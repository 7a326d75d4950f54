import { describe, expect, test } from "bun:test";
import { auditEventProblems, auditPageProblems, cidrProblem, keyInfoProblems } from "../helpers/spec-types.ts";

/** The spec checker must catch each kind of deviation, or the endpoint tests that rely on it prove nothing. */

const KEY_ID = "0b7d9a52-3f4e-4c1a-9d7e-2f6b8c1d0e3a";
const USER = "5e1c2b3a-4d5f-4e6a-8b7c-9d0e1f2a3b4c";

function keyInfo(): { key: Record<string, unknown>; organization: Record<string, unknown> } {
  return {
    key: { id: KEY_ID, kind: "service", scopes: ["inference", "audit:read"], expires_at: "2026-01-31T09:00:00.000Z" },
    organization: { id: USER, plan: "Standard" },
  };
}

function event(): Record<string, unknown> & { actor: Record<string, unknown>; targets: Record<string, unknown>[]; details: Record<string, unknown>; origin: Record<string, unknown> } {
  return {
    id: KEY_ID,
    created_at: "2025-03-01T12:00:00.250Z",
    action: "member.role_changed",
    category: "member",
    actor: { type: "user", id: USER, name: "Ada", email: "ada@example.com", key_id: null },
    targets: [{ key: "target_user_id", kind: "user", id: USER, name: "Ada", email: "ada@example.com" }],
    details: { target_user_id: USER, from: "member", to: "admin" },
    origin: { ip_prefix: "203.0.113.0/24", user_agent_summary: "Firefox/131.0" },
  };
}

describe("key information (spec 2.5)", () => {
  test("a conformant body has no problems", () => {
    expect(keyInfoProblems(keyInfo())).toEqual([]);
  });

  const broken: [string, (b: ReturnType<typeof keyInfo>) => void, string][] = [
    ["expires_at null", (b) => {
      b.key.expires_at = null;
    }, "key.expires_at: expected string, got null"],
    ["expires_at without ms", (b) => {
      b.key.expires_at = "2026-01-31T09:00:00Z";
    }, "key.expires_at: not an ISO 8601"],
    ["expires_at with offset", (b) => {
      b.key.expires_at = "2026-01-31T09:00:00.000+01:00";
    }, "key.expires_at: not an ISO 8601"],
    ["impossible date", (b) => {
      b.key.expires_at = "2026-02-30T09:00:00.000Z";
    }, "key.expires_at: not an ISO 8601"],
    ["id not a UUID", (b) => {
      b.key.id = "k_1";
    }, "key.id: not a UUID"],
    ["unknown kind", (b) => {
      b.key.kind = "robot";
    }, "key.kind"],
    ["unknown scope", (b) => {
      b.key.scopes = ["root"];
    }, "key.scopes[0]: unknown scope"],
    ["extra field", (b) => {
      b.key.name = "x";
    }, "key.name: not a spec field"],
    ["missing field", (b) => void delete b.organization.plan, "organization.plan: missing"],
  ];
  for (const [name, mutate, problem] of broken) {
    test(name, () => {
      const b = keyInfo();
      mutate(b);
      expect(keyInfoProblems(b).join("\n")).toContain(problem);
    });
  }
});

describe("audit event (spec 2.6)", () => {
  test("a conformant event and page have no problems", () => {
    expect(auditEventProblems(event())).toEqual([]);
    expect(auditPageProblems({ data: [event(), { ...event(), actor: { ...event().actor, key_id: KEY_ID } }], next_cursor: "" })).toEqual([]);
  });

  const broken: [string, (e: ReturnType<typeof event>) => void, string][] = [
    ["ip_prefix empty", (e) => {
      e.origin.ip_prefix = "";
    }, "origin.ip_prefix: \"\" not in CIDR"],
    ["ip_prefix a full address", (e) => {
      e.origin.ip_prefix = "203.0.113.7";
    }, "origin.ip_prefix"],
    ["ip_prefix /32", (e) => {
      e.origin.ip_prefix = "203.0.113.7/32";
    }, "full address"],
    ["ip_prefix host bits", (e) => {
      e.origin.ip_prefix = "203.0.113.7/24";
    }, "host bits"],
    ["ipv6 host bits", (e) => {
      e.origin.ip_prefix = "2001:db8::1/48";
    }, "host bits"],
    ["target key not in details", (e) => {
      e.details = {};
    }, 'details has no field "target_user_id"'],
    ["target key holds another id", (e) => {
      e.details.target_user_id = KEY_ID;
    }, "not the target's id"],
    ["category outside the enum", (e) => {
      e.category = "chat";
    }, "category: not a spec category"],
    ["action with one part", (e) => {
      e.action = "login";
    }, "action: not <area>.<verb>"],
    ["action with three parts", (e) => {
      e.action = "a.b.c";
    }, "action: not <area>.<verb>"],
    ["created_at without ms", (e) => {
      e.created_at = "2025-03-01T12:00:00Z";
    }, "created_at: not an ISO 8601"],
    ["key_id not a UUID", (e) => {
      e.actor.key_id = "k";
    }, "actor.key_id: not a UUID"],
    ["actor name null", (e) => {
      e.actor.name = null;
    }, "actor.name: expected string, got null"],
    ["target email null", (e) => {
      (e.targets[0] as Record<string, unknown>).email = null;
    }, "targets[0].email: expected string, got null"],
    ["details null", (e) => void Object.assign(e, { details: null }), "details: expected an object"],
    ["extra top-level field", (e) => {
      e.org_id = USER;
    }, "event.org_id: not a spec field"],
    ["missing origin field", (e) => void delete e.origin.user_agent_summary, "origin.user_agent_summary: missing"],
  ];
  for (const [name, mutate, problem] of broken) {
    test(name, () => {
      const e = event();
      mutate(e);
      expect(auditEventProblems(e).join("\n")).toContain(problem);
    });
  }

  test("the envelope: next_cursor a string, nothing else", () => {
    expect(auditPageProblems({ data: [], next_cursor: null }).join("\n")).toContain("body.next_cursor: expected string, got null");
    expect(auditPageProblems({ data: [], next_cursor: "", total: 0 }).join("\n")).toContain("body.total: not a spec field");
  });

  test("CIDR: the prefixes the gateway writes are accepted", () => {
    for (const p of ["127.0.0.0/8", "0.0.0.0/0", "203.0.113.0/24", "2001:db8:1::/48", "0:0:0::/48", "::/0"]) expect(cidrProblem(p)).toBeNull();
  });
});
