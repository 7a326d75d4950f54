/**
 * Settings the runtime reads only from the environment it was started with.
 *
 * One, for now: MIMALLOC_PURGE_HOLES=0. Bun's mimalloc hands partly free
 * pages back to the kernel every 100 ms by default, and under steady load
 * the server touches them again at once: 2.2 minor page faults a request at
 * 1,000 req/s, ~0.35 without (and the open-loop p99 drops from ~2.3 to
 * ~1.6 ms; README "Benchmarks"). The price is memory kept for reuse: ~30 MB
 * at idle, more after a burst (README "Decisions"). Assigning process.env at
 * runtime has no effect on it, so `serve` re-executes itself once with the
 * variable set when the operator has not set it. This works the same under
 * `bun run src/main.ts` and in the compiled executable (where Bun.main is
 * inside /$bunfs/ and argv[1] is not a script). The parent only forwards
 * signals and the exit code. An operator's own value is kept.
 */

/** Variables `serve` wants at start, each with the value used when the operator set none. */
export function missingRuntimeEnv(env: Record<string, string | undefined> = process.env): Record<string, string> {
  const add: Record<string, string> = {};
  if (env.MIMALLOC_PURGE_HOLES === undefined) add.MIMALLOC_PURGE_HOLES = "0";
  return add;
}

/**
 * Call first thing for long-running commands (`serve`): returns undefined when
 * the environment already has what `missingRuntimeEnv` asks for (carry on),
 * otherwise runs this same command in a child with it added and resolves to
 * the child's exit code.
 */
export async function relaunchWithRuntimeEnv(argv: readonly string[] = process.argv): Promise<number | undefined> {
  const add = missingRuntimeEnv();
  if (Object.keys(add).length === 0 || process.env.GATEWAY_NO_RELAUNCH === "1") return undefined;
  const compiled = Bun.main.startsWith("/$bunfs/") || Bun.main.startsWith("B:/~BUN/");
  const cmd = compiled ? [process.execPath, ...argv.slice(2)] : [process.execPath, Bun.main, ...argv.slice(2)];
  const child = Bun.spawn(cmd, {
    env: { ...process.env, ...add, GATEWAY_PARENT_PID: String(process.pid) },
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
