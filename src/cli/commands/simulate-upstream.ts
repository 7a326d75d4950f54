import { defineCommand } from "../command.ts";
import { int, waitForSignal } from "../context.ts";
import { startSimulator } from "../../sim/index.ts";

export const simulateUpstream = defineCommand({
  group: "simulate-upstream",
  summary: "a simulated vLLM upstream (chat, embeddings, models), for trying the gateway out",
  flags: {
    port: { type: "string", value: "PORT", description: "port to listen on (default 0: a free one)" },
    host: { type: "string", value: "HOST", description: "address to listen on (default 127.0.0.1)" },
    "ttft-ms": { type: "string", value: "N", description: "milliseconds before the first token" },
    "inter-token-ms": { type: "string", value: "N", description: "milliseconds between streamed tokens" },
    tokens: { type: "string", value: "N", description: "completion tokens per answer" },
  },
  common: [],
  notes: ['Prints {"msg":"simulator listening","url":…} and serves until SIGTERM, SIGINT or SIGHUP.'],
  examples: ["gateway simulate-upstream --port 8000 --ttft-ms 50", "UPSTREAM_BASE_URL=http://127.0.0.1:8000/v1 gateway serve"],
  async run({ values }, { out }) {
    const sim = await startSimulator({
      port: values.port ? int(values.port, "--port") : 0,
      hostname: values.host ?? "127.0.0.1",
      ...(values["ttft-ms"] ? { ttftMs: int(values["ttft-ms"], "--ttft-ms") } : {}),
      ...(values["inter-token-ms"] ? { interTokenMs: int(values["inter-token-ms"], "--inter-token-ms") } : {}),
      ...(values.tokens ? { completionTokens: int(values.tokens, "--tokens") } : {}),
    });
    // The stop signals are handled before the line that says it listens: whoever reads that line may signal at
    // once, and a SIGHUP or SIGTERM arriving before the handlers killed it (exit 129 or 143, not 0).
    const signalled = waitForSignal();
    out.stdout(`${JSON.stringify({ msg: "simulator listening", url: sim.url })}\n`);
    await signalled;
    await sim.stop();
    return 0;
  },
});
