/**
 * The reference point for `bun run bench -- --bare`: the smallest Bun proxy
 * (no auth, limits, quota, logs, metrics or validation), forwarding
 * POST /v1/chat/completions to the upstream with fetch and returning its
 * answer as is. What it costs is what Bun's own server and fetch cost on this
 * machine; the gateway's figures are read against it.
 *
 *   bun bench/bare-proxy.ts --upstream http://127.0.0.1:PORT/v1 [--relay js]
 * prints {"url": "..."} and serves until killed.
 *
 * `--relay js` reads the upstream's body in JavaScript and writes each read to
 * a direct stream (write, then flush), as the gateway's relay must (it meters
 * and rewrites what it relays), instead of handing the body to the response:
 * what relaying in JavaScript itself costs, with nothing else done per chunk.
 */
import { parseArgs } from "node:util";

const { values } = parseArgs({ args: Bun.argv.slice(2), options: { upstream: { type: "string" }, port: { type: "string", default: "0" }, relay: { type: "string", default: "native" } } });
const jsRelay = values.relay === "js";
const upstream = values.upstream ?? "";
const server = Bun.serve({
  hostname: "127.0.0.1",
  port: Number(values.port),
  async fetch(req) {
    const r = await fetch(`${upstream}/chat/completions`, { method: "POST", headers: { "content-type": "application/json" }, body: await req.arrayBuffer() });
    const headers = { "content-type": r.headers.get("content-type") ?? "application/json" };
    if (!jsRelay || !r.body) return new Response(r.body, { status: r.status, headers });
    const reader = r.body.getReader();
    const relay: import("bun").DirectUnderlyingSource<Uint8Array> = {
      type: "direct",
      async pull(c) {
        for (;;) {
          const x = await reader.read();
          if (x.done) break;
          c.write(x.value);
          c.flush();
        }
        c.close();
      },
    };
    return new Response(new ReadableStream(relay), { status: r.status, headers });
  },
});
process.stdout.write(`${JSON.stringify({ url: `http://127.0.0.1:${server.port}/v1` })}\n`);
