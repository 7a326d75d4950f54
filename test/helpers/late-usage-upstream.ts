/**
 * A scripted chat upstream for a client that leaves once the answer is
 * complete: each call gets its answer and finish chunk at once, and its usage
 * chunk and [DONE] only when the test sends them (`sendUsage`), or never.
 * The usage counts (1234 prompt, 77 completion) are ones no estimate gives.
 */

/** One call's stream, as the test sees it. */
export interface LateUsageRun {
  controller?: ReadableStreamDefaultController<Uint8Array>;
  /** The gateway closed the upstream call. */
  cancelled: boolean;
}

export interface LateUsageUpstream {
  /** The base URL to configure as an alias's target (`…/v1`). */
  baseUrl: string;
  /** The next call's run (resets it): start one before each request. */
  next(): LateUsageRun;
  /** The usage chunk and [DONE], then the end of the body; true when sent (false: the gateway had closed the call). */
  sendUsage(run: LateUsageRun): boolean;
  stop(): void;
}

const enc = new TextEncoder();

/** `serialise` writes each event's JSON (JSON.stringify by default; a test may space it otherwise). */
export function lateUsageUpstream(model: string, serialise: (v: unknown) => string = JSON.stringify): LateUsageUpstream {
  const frame = (e: unknown) => `data: ${serialise(e)}\n\n`;
  const head = { id: "c1", object: "chat.completion.chunk", created: 1, model };
  // 19 characters of text: an estimate of 5 completion tokens.
  const answer = enc.encode(
    frame({ ...head, choices: [{ index: 0, delta: { role: "assistant", content: "Hello there, friend" }, finish_reason: null }] }) +
      frame({ ...head, choices: [{ index: 0, delta: {}, finish_reason: "stop" }] }),
  );
  const usageAndDone = enc.encode(`${frame({ ...head, choices: [], usage: { prompt_tokens: 1234, completion_tokens: 77, total_tokens: 1311 } })}data: [DONE]\n\n`);
  let run: LateUsageRun = { cancelled: false };
  const server = Bun.serve({
    hostname: "127.0.0.1",
    port: 0,
    async fetch(req) {
      await req.text();
      const r = run;
      return new Response(
        new ReadableStream<Uint8Array>({
          start(c) {
            r.controller = c;
            c.enqueue(answer);
          },
          cancel() {
            r.cancelled = true;
          },
        }),
        { headers: { "content-type": "text/event-stream" } },
      );
    },
  });
  return {
    baseUrl: `http://127.0.0.1:${server.port}/v1`,
    next() {
      run = { cancelled: false };
      return run;
    },
    sendUsage(r) {
      try {
        r.controller?.enqueue(usageAndDone);
        r.controller?.close();
        return true;
      } catch {
        return false;
      }
    },
    stop: () => server.stop(true),
  };
}
