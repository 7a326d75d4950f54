/**
 * Bun's fetch sends at most BUN_CONFIG_MAX_HTTP_REQUESTS requests at once
 * (default 256) and silently queues the rest, so an upstream stream beyond the
 * 256th would wait for one to finish. Bun reads the variable once, from the
 * environment it was started with (or a .env file it autoloads):
 * assigning process.env at runtime, even before the first fetch, has no
 * effect, and neither does setenv(3) through FFI (both tested on Bun 1.4.5).
 * Values above 65535 are refused (and the default applies).
 *
 * So `serve` re-executes itself once with the variable set when the operator
 * has not set it. This works the same under `bun run src/main.ts` and in the
 * compiled executable (where Bun.main is inside /$bunfs/ and argv[1] is not a
 * script). The parent only forwards signals and the exit code.
 */

export const FETCH_CONCURRENCY = 16_384;

/** Whether this process already runs with a raised cap (set by the operator, or by a re-exec). */
export function fetchCapRaised(env: Record<string, string | undefined> = process.env): boolean {
  const v = Number(env.BUN_CONFIG_MAX_HTTP_REQUESTS);
  return Number.isInteger(v) && v > 256 && v <= 65_535;
}

/**
 * Call first thing for long-running commands (`serve`): returns undefined when
 * the cap is already raised (carry on), otherwise runs this same command in a
 * child with the cap raised and resolves to the child's exit code.
 */
export async function relaunchWithFetchCap(argv: readonly string[] = process.argv): Promise<number | undefined> {
  if (fetchCapRaised() || process.env.GATEWAY_NO_RELAUNCH === "1") return undefined;
  const compiled = Bun.main.startsWith("/$bunfs/") || Bun.main.startsWith("B:/~BUN/");
  const cmd = compiled ? [process.execPath, ...argv.slice(2)] : [process.execPath, Bun.main, ...argv.slice(2)];
  const child = Bun.spawn(cmd, {
    env: { ...process.env, BUN_CONFIG_MAX_HTTP_REQUESTS: String(FETCH_CONCURRENCY), GATEWAY_PARENT_PID: String(process.pid) },
    stdio: ["inherit", "inherit", "inherit"],
  });
  for (const sig of ["SIGTERM", "SIGINT", "SIGHUP"] as const) process.on(sig, () => child.kill(sig));
  return await child.exited;
}

/**
 * In a re-executed child: if the parent disappears (SIGKILLed, so it could not
 * forward a signal), shut down gracefully instead of living on as an orphan
 * that still holds the port and the data directory.
 */
export function watchParent(onOrphaned: () => void, env: Record<string, string | undefined> = process.env): void {
  const parent = Number(env.GATEWAY_PARENT_PID);
  if (!Number.isInteger(parent) || parent <= 0) return;
  const timer = setInterval(() => {
    if (process.ppid !== parent) {
      clearInterval(timer);
      onOrphaned();
    }
  }, 500);
  timer.unref?.();
}
