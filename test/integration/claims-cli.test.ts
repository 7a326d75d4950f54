import { afterAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { existsSync, mkdirSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { captureCli, withoutEnv } from "../helpers/cli.ts";
import { removeScratch, scratchDir } from "../helpers/process.ts";

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
