/**
 * Wait for a condition instead of sleeping for a guessed time: on a shared
 * 2-core machine any fixed sleep is either too short (flaky) or too long
 * (slow). Polls `check` until it returns true, or fails with `what` after
 * `timeoutMs`.
 */
export async function until(check: () => boolean | Promise<boolean>, what: string, timeoutMs = 10_000, everyMs = 5): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (await check()) return;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for: ${what}`);
    await Bun.sleep(everyMs);
  }
}

/** Poll `get` until `accept` holds for its value; returns that value. */
export async function eventually<T>(get: () => Promise<T> | T, accept: (v: T) => boolean, what: string, timeoutMs = 10_000, everyMs = 20): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await get();
    if (accept(v)) return v;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for: ${what} (last: ${String(v)})`);
    await Bun.sleep(everyMs);
  }
}
