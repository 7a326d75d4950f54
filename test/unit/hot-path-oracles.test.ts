import { describe, expect, test } from "bun:test";
import { TypeCompiler } from "@sinclair/typebox/compiler";
import fc from "fast-check";
import { CLOSED_SCHEMAS, closedCheck } from "../../src/inference/model.ts";
import { contentLength } from "../../src/inference/upstream/http1-conn.ts";
import { parseHead } from "../../src/inference/upstream/http1-head.ts";

/**
 * The hot-path rewrites (closedCheck, parseHead by index, contentLength's
 * fast path) held to the code they replaced, kept here as oracles, on random
 * and hostile input. Replay with FUZZ_SEED=….
 */
const SEED = Number(process.env.FUZZ_SEED ?? Date.now() % 2_147_483_647);
const params = { seed: SEED, numRuns: 3_000 };
console.log(`hot-path oracles seed=${SEED}`);

/** parseHead as it was before b57c34b (status line by exec, each line sliced, then its name and value). */
function oldParseHead(text: string) {
  const lineAt = (from: number, eol: number) => {
    let end = eol === -1 ? text.length : eol;
    if (end > from && text.charCodeAt(end - 1) === 0x0d) end--;
    return text.slice(from, end);
  };
  let eol = text.indexOf("\n");
  const first = lineAt(0, eol);
  const m = /^HTTP\/1\.([01]) ([1-5]\d\d)(?: .*)?$/.exec(first);
  if (!m) return `not an HTTP/1.x status line: ${JSON.stringify(first.slice(0, 80))}`;
  const headers = new Map<string, string>();
  let pos = eol + 1;
  while (eol !== -1) {
    eol = text.indexOf("\n", pos);
    const line = lineAt(pos, eol);
    pos = eol + 1;
    const c = line.charCodeAt(0);
    if (c === 0x20 || c === 0x09) return `obs-fold (a folded header line) in the response head: ${JSON.stringify(line.slice(0, 80))}`;
    const colon = line.indexOf(":");
    if (colon <= 0) return `malformed header line: ${JSON.stringify(line.slice(0, 80))}`;
    const name = line.slice(0, colon).trim().toLowerCase();
    const value = line.slice(colon + 1).trim();
    const prev = headers.get(name);
    headers.set(name, prev === undefined ? value : `${prev}, ${value}`);
  }
  const connection = headers.get("connection")?.toLowerCase() ?? "";
  const http10 = m[1] === "0";
  const keepAlive = http10 ? /\bkeep-alive\b/.test(connection) : !/\bclose\b/.test(connection);
  return { status: Number(m[2]), headers, keepAlive, http10 };
}

/** contentLength as it was before b57c34b. */
function oldContentLength(v: string): number | undefined {
  let n: number | undefined;
  for (const part of v.split(",")) {
    const d = part.trim().replace(/^0+(?=.)/, "");
    if (!/^\d{1,16}$/.test(d)) return undefined;
    const x = Number(d);
    if (!Number.isSafeInteger(x) || (n !== undefined && x !== n)) return undefined;
    n = x;
  }
  return n;
}

// Pieces a head is made of: the usual, the odd (bare CR/LF, folds, colons, Unicode spaces trim takes).
const headPiece = fc.oneof(
  fc.constantFrom(
    "HTTP/1.1 200 OK", "HTTP/1.0 404 Not Found", "HTTP/1.1 204", "HTTP/1.1 599 x", "HTTP/1.1 600", "HTTP/1.10 200", "HTTP/1.1 20", "http/1.1 200",
    "\r\n", "\n", "\r", ":", " ", "\t", "\v", "\f", "\u00a0", "\u2028", "\ufeff", "\u3000",
    "Content-Length: 12", "connection: close", "Connection: Keep-Alive, Upgrade", "X-A: 1", "x-a:2", "transfer-encoding : chunked", "\r\n x-fold: 1", "é: ü",
  ),
  fc.string({ maxLength: 6 }),
  fc.string({ unit: "binary", maxLength: 4 }),
);
const head = fc.tuple(fc.constantFrom("", "HTTP/1.1 200 OK\r\n", "HTTP/1.0 200 OK\n", "HTTP/1.1 301"), fc.array(headPiece, { maxLength: 12 })).map(([a, b]) => a + b.join(""));

describe("parseHead = the parser it replaced", () => {
  test("same status, headers, keepAlive, http10 and errors on random heads", () => {
    fc.assert(
      fc.property(head, (text) => {
        expect(parseHead(text)).toEqual(oldParseHead(text));
      }),
      params,
    );
  });
});

describe("contentLength = the function it replaced", () => {
  test("on random digit-heavy strings", () => {
    const value = fc.oneof(
      fc.array(fc.constantFrom("0", "1", "9", "7", ",", " ", "\t", "+", "-", ".", "e", "x", "\u0660", "\uff11", "\n"), { maxLength: 24 }).map((a) => a.join("")),
      fc.bigInt({ min: 0n, max: 10n ** 20n }).map(String),
      // Around 2^53 and the fast path's 15 digits: 14 to 17 digits.
      fc.tuple(fc.integer({ min: 14, max: 17 }), fc.array(fc.constantFrom("0", "1", "5", "9"), { minLength: 17, maxLength: 17 })).map(([n, d]) => d.slice(0, n).join("")),
      fc.tuple(fc.nat({ max: 20 }), fc.bigInt({ min: 0n, max: 10n ** 17n })).map(([z, n]) => "0".repeat(z) + n),
      fc.string(),
    );
    fc.assert(
      fc.property(value, (v) => {
        expect(contentLength(v)).toBe(oldContentLength(v));
      }),
      params,
    );
  });
});

describe("closedCheck = TypeBox's strict check", () => {
  const schemas = Object.entries(CLOSED_SCHEMAS);
  const strict = new Map(schemas.map(([n, s]) => [n, TypeCompiler.Compile(s)]));
  const closed = new Map(schemas.map(([n, s]) => [n, closedCheck(s)]));
  const KEYS = [
    ...new Set(schemas.flatMap(([, s]) => Object.keys(s.properties))),
    "__proto__", "constructor", "toString", "hasOwnProperty", "valueOf", "", "extra", "0", "length",
  ];
  const leaf = fc.oneof(
    fc.constantFrom("m", "user", "system", "assistant", "tool", "", "x".repeat(70), true, false, null, 0, 1, -1, 0.5, 2.5, 1e300, 2 ** 53),
    fc.string({ maxLength: 4 }),
  );
  const { tree } = fc.letrec((t) => ({
    tree: fc.oneof({ depthSize: "small", withCrossShrink: true }, leaf, t("obj"), fc.array(t("tree"), { maxLength: 3 })),
    obj: fc.dictionary(fc.constantFrom(...KEYS), t("tree"), { maxKeys: 5 }),
  }));
  /** A valid value of each schema, then now and then a key added or a value swapped for anything. */
  const BASES: Record<string, Record<string, unknown>> = {
    ChatBody: { model: "m", messages: [{ role: "user", content: "hi" }], stream: false, max_tokens: 5 },
    SystemMessage: { role: "system", content: "be brief", name: "n" },
    UserMessage: { role: "user", content: [{ type: "text", text: "t" }] },
    AssistantMessage: { role: "assistant", content: null, tool_calls: [{ id: "c", type: "function", function: { name: "f", arguments: "{}" } }], refusal: null },
    ToolMessage: { role: "tool", content: "42", tool_call_id: "c" },
  };
  const near = (name: string) =>
    fc
      .tuple(
        fc.subarray(Object.keys(BASES[name] ?? {})),
        fc.option(fc.tuple(fc.constantFrom(...KEYS), tree), { freq: 2 }),
        fc.option(fc.tuple(fc.constantFrom(...KEYS), tree), { freq: 3 }),
      )
      .map(([keep, add, add2]) => {
        const base = BASES[name] ?? {};
        // Built as JSON text: a "__proto__" key is then an own key, as JSON.parse makes it.
        const entries = keep.map((k) => [k, base[k]] as [string, unknown]);
        if (add) entries.push(add);
        if (add2) entries.push(add2);
        return `{${entries.map(([k, v]) => `${JSON.stringify(k)}:${JSON.stringify(v) ?? "null"}`).join(",")}}`;
      });
  const names = schemas.map(([n]) => n);
  /** Whatever JSON.parse can make. */
  const json = fc.constantFrom(...names).chain((name) =>
    fc.tuple(fc.constant(name), fc.oneof(near(name), near(name), tree.map((v) => JSON.stringify(v) ?? "null"), fc.jsonValue().map((v) => JSON.stringify(v)))),
  );

  test("the same values pass on random JSON (bodies, messages, anything)", () => {
    let passed = 0;
    fc.assert(
      fc.property(json, ([name, text]) => {
        const v: unknown = JSON.parse(text);
        const ok = strict.get(name)?.Check(v);
        if (ok) passed++;
        expect({ name, v, ok: closed.get(name)?.Check(v) }).toEqual({ name, v, ok });
      }),
      params,
    );
    // Not a test of refusals only: a fair share of the values pass.
    expect(passed).toBeGreaterThan(params.numRuns / 50);
  });

  test("a JSON '__proto__' or 'constructor' key, an array, null are refused, with the strict schema's errors", () => {
    const c = closed.get("UserMessage");
    for (const v of [
      JSON.parse('{"role":"user","content":"hi","__proto__":{}}'),
      JSON.parse('{"role":"user","content":"hi","constructor":"x"}'),
      [{ role: "user", content: "hi" }],
      null,
    ]) {
      expect(c?.Check(v)).toBe(false);
      expect([...(c?.Errors(v) ?? [])].length).toBeGreaterThan(0);
    }
  });
});
