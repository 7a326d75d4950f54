/**
 * The reference point for `bun run bench -- --bare`: the smallest Bun proxy
 * (no auth, limits, quota, logs, metrics or validation), forwarding
 * POST /v1/chat/completions to the upstream with fetch and returning its
 * answer as is. What it costs is what Bun's own server and fetch cost on this
 * machine; the gateway's figures are read against it.
 *
 *   bun bench/bare-proxy.ts --upstream http://127.0.0.1:PORT/v1
 * prints {"url": "..."} and serves until killed.
 */
import { parseArgs } from "node:util";

const { values } = parseArgs({ args: Bun.argv.slice(2), options: { upstream: { type: "string" }, port: { type: "string", default: "0" } } });
const upstream = values.upstream ?? "";
const server = Bun.serve({
  hostname: "127.0.0.1",
  port: Number(values.port),
  async fetch(req) {
    const r = await fetch(`${upstream}/chat/completions`, { method: "POST", headers: { "content-type": "application/json" }, body: await req.arrayBuffer() });
    return new Response(r.body, { status: r.status, headers: { "content-type": r.headers.get("content-type") ?? "application/json" } });
  },
});
process.stdout.write(`${JSON.stringify({ url: `http://127.0.0.1:${server.port}/v1` })}\n`);
