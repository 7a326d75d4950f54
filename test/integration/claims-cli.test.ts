import { afterAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { existsSync, mkdirSync, readdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { type SQL, sql } from "drizzle-orm";
import { openDatabase } from "../../src/db/client.ts";
import { captureCli, withoutEnv } from "../helpers/cli.ts";
import { TEST_DATABASE_URL } from "../helpers/harness.ts";
import { createScratchDatabase, onlyJson, removeScratch, scratchDir } from "../helpers/process.ts";

// Each case opens (and migrates) an embedded database: seconds each on a busy 2-core machine.
setDefaultTimeout(300_000);

/**
 * README, CLI: "Bad arguments: a message on stderr, exit code 2, nothing
 * written." cli.test holds it for the database's rows; this holds it for the
 * data directory itself, which a refused command must not create.
 */

// runCli reads process.env: keep a developer's own settings out of these tests.
const SCRUB = ["DATABASE_URL", "GATEWAY_CONFIG", "GATEWAY_DATA_DIR", "LOG_LEVEL"];
withoutEnv(SCRUB);
afterAll(removeScratch);

const NO_ORG = "00000000-0000-4000-8000-000000000000";

describe("a refused command on a data directory that does not exist yet", () => {
  test("exit 2 with its message, and neither the directory nor a missing parent of it is created", async () => {
    const work = scratchDir("gw-claims-cli-");
    // Refused by the service's own checks once the database is open (plan, e-mail, scope), and by a lookup in it (no such organisation).
    const cases: [string[], string][] = [
      [["orgs", "create", "--name", "X", "--plan", "Nope"], 'unknown plan "Nope"'],
      [["users", "create", "--org", NO_ORG, "--name", "A", "--email", "not-an-address"], "--email is not an e-mail address"],
      [["keys", "create", "--org", NO_ORG, "--kind", "service", "--scopes", "bogus"], 'unknown scope "bogus"'],
      [["usage", "report", "--org", NO_ORG], `no organisation ${NO_ORG}`],
    ];
    const created: string[] = [];
    let i = 0;
    for (const [args, message] of cases) {
      // A parent that does not exist either: a mistyped --data-dir must not leave a tree behind.
      const parent = join(work, `p${i++}`);
      const dataDir = join(parent, "data");
      const r = await captureCli([...args, "--data-dir", dataDir]);
      expect({ args: args.join(" "), code: r.code, stdout: r.stdout }).toEqual({ args: args.join(" "), code: 2, stdout: "" });
      expect(r.stderr).toStartWith("error: ");
      expect(r.stderr).toContain(message);
      if (existsSync(parent)) created.push(args.join(" "));
    }
    expect(created).toEqual([]);
    expect(readdirSync(work)).toEqual([]);
  });

  test("a command that succeeds creates it (migrate's and orgs create's first run), and a refusal on an existing one leaves it and its rows", async () => {
    const work = scratchDir("gw-claims-cli-");
    const dataDir = join(work, "nested", "data");
    const made = await captureCli(["orgs", "create", "--name", "First", "--data-dir", dataDir, "--json"]);
    expect(made.code).toBe(0);
    expect(existsSync(join(dataDir, "pg"))).toBe(true);
    const refused = await captureCli(["orgs", "create", "--name", "X", "--plan", "Nope", "--data-dir", dataDir]);
    expect(refused.code).toBe(2);
    expect(existsSync(join(dataDir, "pg"))).toBe(true);
    const id = (JSON.parse(made.stdout) as { id: string }).id;
    const listed = await captureCli(["keys", "list", "--org", id, "--data-dir", dataDir, "--json"]);
    expect(listed).toMatchObject({ code: 0, stdout: "[]\n" });
    // An existing, empty directory (made by the operator, e.g. systemd's StateDirectory) is kept, and left empty.
    const empty = join(work, "empty");
    mkdirSync(empty);
    expect((await captureCli(["orgs", "create", "--name", "X", "--plan", "Nope", "--data-dir", empty])).code).toBe(2);
    expect(readdirSync(empty)).toEqual([]);
  });
});

describe("docs/decisions.md, Command line: help and required flags come first", () => {
  test("--help or -h among a command's arguments prints its usage, exit 0, even beside an unknown flag, a repeated one or a bad value", async () => {
    const usage = (await captureCli(["keys", "create", "--help"])).stdout;
    expect(usage).toStartWith("gateway keys create: ");
    for (const args of [
      ["keys", "create", "--bogus", "--help"],
      ["keys", "create", "-h", "--bogus"],
      ["keys", "create", "--kind", "service", "--kind", "personal", "--help"],
      ["keys", "create", "--org", "not-a-uuid", "--expires-in", "forever", "-h"],
      ["keys", "create", "--models", "", "--help"],
    ]) {
      const r = await captureCli(args);
      expect({ args: args.join(" "), code: r.code, stderr: r.stderr, same: r.stdout === usage }).toEqual({ args: args.join(" "), code: 0, stderr: "", same: true });
    }
    // After `--`, --help is an argument like any other, not a request for help.
    const r = await captureCli(["keys", "revoke", "--", "--help"]);
    expect(r.code).toBe(2);
    expect(r.stdout).toBe("");
  });

  test("a missing required flag is named before the configuration is read: a broken config file does not hide it", async () => {
    const work = scratchDir("gw-claims-cli-");
    const broken = join(work, "broken.json");
    await Bun.write(broken, "{ not json");
    const dataDir = join(work, "data");
    for (const [args, missing] of [
      [["orgs", "create"], "--name"],
      [["keys", "create", "--org", NO_ORG, "--kind", "service"], "--scopes"],
      [["usage", "report"], "--org"],
      [["users", "create", "--org", NO_ORG, "--name", "A"], "--email"],
    ] as const) {
      const r = await captureCli([...args, "--config", broken, "--data-dir", dataDir]);
      expect({ args: args.join(" "), code: r.code, stdout: r.stdout, stderr: r.stderr }).toEqual({ args: args.join(" "), code: 2, stdout: "", stderr: `error: missing ${missing}\n` });
    }
    // With the flags given, the configuration is what is refused (so it was read after them, not never).
    const r = await captureCli(["orgs", "create", "--name", "X", "--config", broken, "--data-dir", dataDir]);
    expect(r.code).toBe(2);
    expect(r.stderr).toContain("invalid configuration");
    expect(existsSync(dataDir)).toBe(false);
  });
});

describe("docs/decisions.md, Rows read from the database: the admin commands read a hand-edited key or organisation row too", () => {
  test("times out of JavaScript's range (±infinity, past year 275760) or in years 0001-0099: keys list shows them as /v1/me does, keys revoke revokes, keys rotate refuses an expired key, orgs set changes the organisation", async () => {
    const work = scratchDir("gw-claims-rows-");
    // On the suite's Postgres when it runs on one (a scratch database named in the config file), else embedded.
    const pg = TEST_DATABASE_URL ? await createScratchDatabase(TEST_DATABASE_URL, "gw_rows_cli") : undefined;
    const file = join(work, "gateway.json");
    writeFileSync(file, JSON.stringify(pg ? { databaseUrl: pg.url } : {}));
    const dataDir = join(work, "data");
    const cli = (...args: string[]) => captureCli([...args, "--config", file, "--data-dir", dataDir]);
    const edit = async (statement: SQL) => {
      const db = await openDatabase(pg ? { databaseUrl: pg.url, dataDir: "memory://", poolMax: 1 } : { dataDir });
      try {
        return await db.rows<Record<string, string | null>>(statement);
      } finally {
        await db.close();
      }
    };
    try {
      const org = onlyJson<{ id: string }>((await cli("orgs", "create", "--name", "Edited", "--json")).stdout).id;
      const key = async () => onlyJson<{ id: string }>((await cli("keys", "create", "--org", org, "--kind", "service", "--scopes", "inference", "--json")).stdout).id;
      const [forever, expired, beyond, ancient] = [await key(), await key(), await key(), await key()];
      await edit(sql`update api_keys set expires_at = 'infinity' where id = ${forever}`);
      await edit(sql`update api_keys set expires_at = '-infinity' where id = ${expired}`);
      await edit(sql`update api_keys set expires_at = '294276-01-01 00:00:00Z', last_used_at = '0050-06-15 12:00:00Z' where id = ${beyond}`);
      await edit(sql`update api_keys set created_at = '0099-12-31 23:59:59.999Z' where id = ${ancient}`);
      await edit(sql`update organizations set created_at = '-infinity' where id = ${org}`);

      // Before: "error: Invalid Date", exit 1, for the whole organisation's list.
      const listed = await cli("keys", "list", "--org", org, "--json");
      expect({ code: listed.code, stderr: listed.stderr }).toEqual({ code: 0, stderr: "" });
      const byId = new Map(onlyJson<{ id: string; expires_at: string; last_used_at: string | null; created_at: string }[]>(listed.stdout).map((k) => [k.id, k]));
      expect(byId.get(forever)?.expires_at).toBe("9999-12-31T23:59:59.999Z");
      expect(byId.get(expired)?.expires_at).toBe("0001-01-01T00:00:00.000Z");
      expect(byId.get(beyond)?.expires_at).toBe("9999-12-31T23:59:59.999Z");
      // Years 0001-0099 as stored (a driver's Date reads them as 19xx).
      expect(byId.get(beyond)?.last_used_at).toBe("0050-06-15T12:00:00.000Z");
      expect(byId.get(ancient)?.created_at).toBe("0099-12-31T23:59:59.999Z");
      expect((await cli("keys", "list", "--org", org)).code).toBe(0);

      // A key that never expires (valid on every request) is revoked: before, exit 1 and the revocation rolled back.
      const revoked = await cli("keys", "revoke", forever, "--json");
      expect({ code: revoked.code, stderr: revoked.stderr }).toEqual({ code: 0, stderr: "" });
      expect(onlyJson<{ revoked_at: string | null }>(revoked.stdout).revoked_at).not.toBeNull();
      const [row] = await edit(sql`select revoked_at::text as revoked_at from api_keys where id = ${forever}`);
      expect(row?.revoked_at).not.toBeNull();
      // An expiry before year 1 is an expired key (decisions.md): rotating it is refused, exit 2, as for any expired key.
      const rotated = await cli("keys", "rotate", expired);
      expect({ code: rotated.code, stderr: rotated.stderr }).toEqual({ code: 2, stderr: `error: key ${expired} has expired; create a new key instead\n` });
      // A key living past year 9999 rotates; the new key's expiry is one the gateway can read back, within 9999.
      const fresh = await cli("keys", "rotate", beyond, "--json");
      expect({ code: fresh.code, stderr: fresh.stderr }).toEqual({ code: 0, stderr: "" });
      const made = onlyJson<{ id: string; expires_at: string; old_key_expires_at: string }>(fresh.stdout);
      const [stored] = await edit(sql`select (expires_at <= '9999-12-31 23:59:59.999Z') as within from api_keys where id = ${made.id}`);
      expect(String(stored?.within)).toBe("true");
      expect(Date.parse(made.old_key_expires_at)).toBeLessThan(Date.now() + 25 * 3_600_000);

      // An organisation whose created_at was edited can still be changed.
      const set = await cli("orgs", "set", "--id", org, "--plan", "Ultra", "--json");
      expect({ code: set.code, stderr: set.stderr }).toEqual({ code: 0, stderr: "" });
      expect(onlyJson<{ plan: string; created_at: string }>(set.stdout)).toMatchObject({ plan: "Ultra", created_at: "0001-01-01T00:00:00.000Z" });
    } finally {
      await pg?.drop();
    }
  });
});
