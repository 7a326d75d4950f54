import { createKey, createOrg, createUser, keyLifetime } from "../admin/service.ts";
import { recordAudit } from "../audit/record.ts";
import type { Gateway } from "../server.ts";

/** Seed the demo organisation and print ready-to-paste requests. */
export async function seedDemo(gw: Gateway): Promise<string> {
  const db = gw.database;
  const cfg = gw.config;
  const org = await createOrg(db, { name: "Demo Org", plan: cfg.defaultPlan, plans: Object.keys(cfg.plans), quotaTokens: 1_000_000, quotaWindow: "day" });
  const user = await createUser(db, { orgId: org.id, name: "Ada Lovelace", email: "ada@demo.example" });
  const common = { orgId: org.id, knownModels: Object.keys(cfg.aliases), tag: cfg.keyTag, lifetime: keyLifetime(cfg.keys) };
  const personal = await createKey(db, { ...common, userId: user.id, kind: "personal", scopes: ["inference"], name: "ada laptop" });
  const service = await createKey(db, { ...common, kind: "service", scopes: ["inference", "audit:read"], name: "demo backend" });
  const actor = { type: "user", id: user.id, name: user.name, email: user.email, keyId: null };
  const target = { key: "target_user_id", kind: "user", id: crypto.randomUUID(), name: "Grace Hopper", email: "grace@demo.example" };
  const group = { key: "group_id", kind: "group", id: crypto.randomUUID(), name: "Research", email: "" };
  // Sample events as the platform would log them for a person in a browser:
  // a documentation prefix (RFC 5737), and each target's id in its details field (spec 2.6).
  const browser = { ipPrefix: "203.0.113.0/24", userAgentSummary: "Firefox/131.0" };
  await recordAudit(db.db, [
    { orgId: org.id, action: "member.invited", category: "member", actor, targets: [target], details: { target_user_id: target.id, role: "member" }, origin: browser },
    {
      orgId: org.id,
      action: "member.role_changed",
      category: "member",
      actor,
      targets: [target],
      details: { target_user_id: target.id, from: "member", to: "admin" },
      origin: browser,
    },
    { orgId: org.id, action: "group.created", category: "group", actor, targets: [group], details: { group_id: group.id }, origin: browser },
  ]);
  const u = gw.url;
  return `
Demo organisation ${org.id} is ready.
  personal key (inference):            ${personal.key}
  service key  (inference, audit:read): ${service.key}

Try:
  curl -s ${u}/v1/me -H "Authorization: Bearer ${personal.key}"
  curl -s ${u}/v1/models -H "Authorization: Bearer ${personal.key}"
  curl -s ${u}/v1/chat/completions -H "Authorization: Bearer ${personal.key}" -H "Content-Type: application/json" \\
    -d '{"model":"svc-fast","messages":[{"role":"user","content":"Hello!"}]}'
  curl -sN ${u}/v1/chat/completions -H "Authorization: Bearer ${personal.key}" -H "Content-Type: application/json" \\
    -d '{"model":"svc-fast","stream":true,"messages":[{"role":"user","content":"Hello!"}]}'
  curl -s ${u}/v1/responses -H "Authorization: Bearer ${personal.key}" -H "Content-Type: application/json" \\
    -d '{"model":"svc-fast","input":"Hello!"}'
  curl -s ${u}/v1/embeddings -H "Authorization: Bearer ${personal.key}" -H "Content-Type: application/json" \\
    -d '{"model":"svc-embed","input":"Paris"}'
  curl -s "${u}/v1/audit-events?limit=5" -H "Authorization: Bearer ${service.key}"

Or with the OpenAI SDK: new OpenAI({ baseURL: "${u}/v1", apiKey: "<a key above>" })
Stop with Ctrl-C.
`;
}
