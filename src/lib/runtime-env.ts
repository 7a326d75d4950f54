/**
 * Settings the runtime reads only from the environment it was started with.
 *
 * One, for now: MIMALLOC_PURGE_HOLES=0. Bun's mimalloc hands partly free
 * pages back to the kernel every 100 ms by default, and under steady load the
 * server touches them again at once, as minor page faults (figures in
 * docs/benchmarks.md, the trade-off in docs/decisions.md "The allocator").
 * Assigning process.env at runtime has no effect on it, and `serve` does not
 * re-execute itself to set it (a second process, signal forwarding and an
 * orphan watch for one variable): the systemd units set it, and `serve` warns
 * once at start when it is unset.
 */

/**
 * The warning `serve` logs at start when the allocator setting is missing from its environment (undefined when set).
 * Empty is missing: an empty variable counts as unset (README, Configuration), and mimalloc reads an empty
 * value as its default too (purge_holes 1), so `MIMALLOC_PURGE_HOLES=` in an env file warned nothing and kept
 * the behaviour the warning is about.
 */
export function runtimeEnvWarning(env: Record<string, string | undefined> = process.env): string | undefined {
  if (env.MIMALLOC_PURGE_HOLES !== undefined && env.MIMALLOC_PURGE_HOLES !== "") return undefined;
  return "MIMALLOC_PURGE_HOLES is unset: the allocator returns freed pages to the kernel every 100 ms and a busy server faults them back in (more page faults and a longer latency tail under load); start the gateway with MIMALLOC_PURGE_HOLES=0 in its environment (the systemd units set it), or =1 to keep this behaviour and silence the warning";
}
