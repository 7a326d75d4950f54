import { beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { sql } from "drizzle-orm";
import { revokeKey } from "../../src/admin/service.ts";
import { lookupKey } from "../../src/auth/key-row.ts";
import { mintKey } from "../../src/auth/keys.ts";
import type { Principal } from "../../src/auth/types.ts";
import { AUTH_CHANNEL, type KeyVerifier, createKeyVerifier } from "../../src/auth/verify.ts";
import type { Database } from "../../src/db/client.ts";
import { apiKeys } from "../../src/db/schema.ts";
import { type SeededOrg, seedOrg, sharedDatabase } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";

setDefaultTimeout(30_000);

/**
 * The key verifier's cache against changes that race a lookup (issue 13 item
 * 10), with forced interleavings: the verifier is the real one, built with a
 * lookup that reads the real row and then waits at a gate the test opens.
 * Notifications arrive through the real LISTEN connection.
 */

let db: Database;
beforeAll(async () => {
  db = await sharedDatabase();
});

/** A lookup that reads the row, then (for the reads listed in `pauseOn`) waits until released. */
function pausingLookup(pauseOn: number[]) {
  let reads = 0;
  let release = () => {};
  const gate = new Promise<void>((r) => {
    release = r;
  });
  let signalRead = () => {};
  const firstReadDone = new Promise<void>((r) => {
    signalRead = r;
  });
  return {
    reads: () => reads,
    release,
    firstReadDone,
    async lookup(hash: string): Promise<Principal | null> {
      const p = await lookupKey(db, hash);
      reads++;
      if (pauseOn.includes(reads)) {
        signalRead();
        await gate;
      }
      return p;
    },
  };
}

/**
 * Resolves once `message` has been delivered on the auth channel. Subscribed
 * after the verifier, so the verifier's own handler has run by then.
 */
async function delivered(message: string): Promise<{ seen: Promise<void>; stop: () => Promise<void> }> {
  let done = () => {};
  const seen = new Promise<void>((r) => {
    done = r;
  });
  const stop = await db.listen(AUTH_CHANNEL, (p) => p === message && done(), () => {});
  return { seen, stop };
}

function verifierWith(lookup: (hash: string) => Promise<Principal | null>): KeyVerifier {
  return createKeyVerifier(db, { ttlMs: 60_000, max: 1_000, negativeTtlMs: 60_000, negativeMax: 1_000, lookup });
}

type PausingLookup = ReturnType<typeof pausingLookup>;

/**
 * One race: an organisation, a lookup that pauses after its first read, a
 * started verifier over it (`lookupOf` may route some hashes past the pause),
 * and a listener for the auth-channel `message` (a function of the org).
 * Whatever `race` does, the lookup is released and both are stopped after it.
 */
async function racing(
  message: string | ((org: SeededOrg) => string),
  race: (r: { org: SeededOrg; l: PausingLookup; verifier: KeyVerifier; note: { seen: Promise<void> } }) => Promise<void>,
  lookupOf: (l: PausingLookup) => (hash: string) => Promise<Principal | null> = (l) => l.lookup,
): Promise<void> {
  const org = await seedOrg(db);
  const l = pausingLookup([1]);
  const verifier = verifierWith(lookupOf(l));
  await verifier.start();
  const note = await delivered(typeof message === "string" ? message : message(org));
  try {
    await race({ org, l, verifier, note });
  } finally {
    l.release();
    await note.stop();
    await verifier.stop();
  }
}

describe("revocation racing a lookup", () => {
  test("a row read before the revocation committed is not cached after the NOTIFY passed", async () => {
    await racing(
      (org) => `key:${org.serviceKeyId}`,
      async ({ org, l, verifier, note }) => {
        const first = verifier.verify(org.serviceKey);
        await l.firstReadDone; // the unrevoked row is in hand
        await revokeKey(db, org.serviceKeyId);
        await note.seen; // the invalidation has passed while the lookup was still out
        l.release();
        // The request that raced the revocation may be served (it read before the commit)…
        expect((await first).status).toBe("valid");
        // …but what it read is not remembered: the next request reads the revoked row.
        expect((await verifier.verify(org.serviceKey)).status).toBe("revoked");
        expect(l.reads()).toBe(2);
      },
    );
  });

  test("a request arriving after the NOTIFY does not join a lookup that started before it", async () => {
    await racing(
      (org) => `key:${org.serviceKeyId}`,
      async ({ org, l, verifier, note }) => {
        const first = verifier.verify(org.serviceKey);
        await l.firstReadDone;
        await revokeKey(db, org.serviceKeyId);
        await note.seen;
        // The old lookup is still paused; this one must read afresh (not wait for it and share its row).
        const second = verifier.verify(org.serviceKey).then((v) => v.status);
        const deadline = Bun.sleep(5_000).then(() => "still waiting for the lookup that began before the NOTIFY");
        expect(await Promise.race([second, deadline])).toBe("revoked");
        l.release();
        await first;
        expect((await verifier.verify(org.serviceKey)).status).toBe("revoked");
      },
    );
  });

  test("a new key elsewhere does not stop a valid key read meanwhile from being cached", async () => {
    // "new" only means an unknown key may now exist: it cannot make a row in hand stale.
    // (Under a steady stream of key creations, discarding such reads left keys uncached,
    // so an outage answered 503 for keys that had just been verified.)
    await racing("new", async ({ org, l, verifier, note }) => {
      const first = verifier.verify(org.serviceKey);
      await l.firstReadDone;
      await db.db.execute(sql`select pg_notify(${AUTH_CHANNEL}, 'new')`);
      await note.seen;
      l.release();
      expect((await first).status).toBe("valid");
      expect((await verifier.verify(org.serviceKey)).status).toBe("valid");
      expect(l.reads()).toBe(1); // served from the cache
    });
  });

  test("a key created while its first lookup was out is not remembered as unknown", async () => {
    // Minted here, inserted only after the lookup has read "no such row".
    const minted = mintKey("gw");
    await racing(
      "new",
      async ({ org, l, verifier, note }) => {
        const first = verifier.verify(minted.key);
        await l.firstReadDone;
        // As `keys create` does it (its secret is minted inside, so the row is written here): row and NOTIFY in one transaction.
        await db.db.transaction(async (tx) => {
          await tx
            .insert(apiKeys)
            .values({ orgId: org.orgId, kind: "service", hash: minted.hash, prefix: minted.prefix, scopes: ["inference"], expiresAt: new Date(Date.now() + 86_400_000) });
          await tx.execute(sql`select pg_notify(${AUTH_CHANNEL}, 'new')`);
        });
        await note.seen;
        l.release();
        expect((await first).status).toBe("unknown");
        expect((await verifier.verify(minted.key)).status).toBe("valid");
      },
      (l) => async (hash) => (hash === minted.hash ? l.lookup(hash) : lookupKey(db, hash)),
    );
  });
});

/**
 * Lookups out at once (docs/decisions.md: key lookups while the database does
 * not answer), with a pool of four (two lookups): the verifier is the real
 * one, its lookup one the test holds or lets through.
 */
describe("key lookups out at once", () => {
  const options = { ttlMs: 60_000, max: 1_000, negativeTtlMs: 60_000, negativeMax: 1_000, lookupTimeoutMs: 300 };
  const outcome = (p: Promise<{ status: string }>) =>
    p.then(
      (v) => v.status,
      (e: Error) => e.constructor.name,
    );

  test("two at a time; given up on, they still count until they settle, and a new one is refused at once meanwhile", async () => {
    const gates: (() => void)[] = [];
    let started = 0;
    const hanging = async (): Promise<Principal | null> => {
      started++;
      await new Promise<void>((r) => gates.push(r));
      return null;
    };
    const verifier = createKeyVerifier({ ...db, poolMax: 4 }, { ...options, lookup: hanging });
    try {
      // Five at once: two start, three wait their turn, all five give up after 300 ms.
      const first = await Promise.all(Array.from({ length: 5 }, () => outcome(verifier.verify(mintKey("gw").key))));
      expect({ first, started, unanswered: verifier.stats().unansweredLookups }).toEqual({
        first: Array(5).fill("AuthStoreUnavailable"),
        started: 2,
        unanswered: 2,
      });
      const t = performance.now();
      expect(await outcome(verifier.verify(mintKey("gw").key))).toBe("AuthStoreUnavailable");
      expect({ started, ms: performance.now() - t < 200 }).toEqual({ started: 2, ms: true });

      // One settles: the count goes down, and the next lookup starts.
      gates.shift()?.();
      await until(() => verifier.stats().unansweredLookups === 1, "the count to go down");
      const next = outcome(verifier.verify(mintKey("gw").key));
      await until(() => started === 3, "the next lookup to start");
      gates.pop()?.(); // its own
      expect(await next).toBe("unknown");
    } finally {
      for (const g of gates) g();
      await verifier.stop();
    }
  });

  test("a healthy database: twenty new keys at once are all verified, two lookups at a time", async () => {
    const orgs = await Promise.all(Array.from({ length: 5 }, () => seedOrg(db)));
    const known = orgs.flatMap((o) => [o.personalKey, o.serviceKey]);
    let out = 0;
    let most = 0;
    const slow = async (hash: string): Promise<Principal | null> => {
      out++;
      most = Math.max(most, out);
      try {
        await Bun.sleep(10);
        return await lookupKey(db, hash);
      } finally {
        out--;
      }
    };
    const verifier = createKeyVerifier({ ...db, poolMax: 4 }, { ...options, lookupTimeoutMs: 5_000, lookup: slow });
    try {
      const unknown = Array.from({ length: 10 }, () => mintKey("gw").key);
      const got = await Promise.all([...known, ...unknown].map((k) => outcome(verifier.verify(k))));
      expect({ got, most }).toEqual({ got: [...Array(10).fill("valid"), ...Array(10).fill("unknown")], most: 2 });
    } finally {
      await verifier.stop();
    }
  });
});
