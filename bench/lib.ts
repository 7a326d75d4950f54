/** Small helpers the benchmark scripts share (each script is its own entry point). */

/** The first line a child process prints (servers print their listening line as JSON first). */
export async function firstLine(stream: ReadableStream<Uint8Array>): Promise<string> {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let text = "";
  while (!text.includes("\n")) {
    const r = await reader.read();
    if (r.done) break;
    text += decoder.decode(r.value, { stream: true });
  }
  reader.releaseLock();
  return text.split("\n")[0] ?? "";
}

/** Polls `f` every 50 ms until it gives a value, or throws after `ms`. */
export async function waitFor<T>(what: string, f: () => T | undefined, ms: number): Promise<T> {
  const until = performance.now() + ms;
  for (;;) {
    const v = f();
    if (v !== undefined) return v;
    if (performance.now() > until) throw new Error(`timed out waiting for ${what}`);
    await Bun.sleep(50);
  }
}
