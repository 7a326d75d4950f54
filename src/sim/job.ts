import type { Fault, SimConfig, SimStats } from "./types.ts";

/** What the endpoints share with the server: the live settings, the fault to apply, counters and requests in flight. */
export interface SimState {
  /** Replaced by a reset: read it where it is used, do not keep it. */
  cfg: SimConfig;
  fault: Fault | null;
  readonly stats: SimStats;
  readonly active: Set<Job>;
}

/**
 * Tracks one inference request from arrival until it completes or the client
 * goes away. Owns at most one timer at a time so cancellation is a single
 * clear and nothing outlives the request.
 */
export class Job {
  done = false;
  private timeout: ReturnType<typeof setTimeout> | undefined;
  private interval: ReturnType<typeof setInterval> | undefined;
  /** Extra teardown (resolve a pending wait, error a stream) run on abort/shutdown. */
  onCancel: (() => void) | undefined;

  constructor(private readonly sim: SimState) {
    sim.stats.inFlight++;
    sim.active.add(this);
  }

  setTimeout(fn: () => void, ms: number): void {
    this.clearTimers();
    this.timeout = setTimeout(fn, ms);
  }

  setInterval(fn: () => void, ms: number): void {
    this.clearTimers();
    this.interval = setInterval(fn, ms);
  }

  private clearTimers(): void {
    if (this.timeout !== undefined) clearTimeout(this.timeout);
    if (this.interval !== undefined) clearInterval(this.interval);
    this.timeout = undefined;
    this.interval = undefined;
  }

  private end(): void {
    this.done = true;
    this.clearTimers();
    this.sim.stats.inFlight--;
    this.sim.active.delete(this);
  }

  finish(): void {
    if (!this.done) this.end();
  }

  /** Client disconnected before we finished. */
  abort(): void {
    if (this.done) return;
    this.sim.stats.aborts++;
    this.end();
    this.runCancel();
  }

  /** Simulator is stopping/refusing; not the client's doing, so not an abort. */
  shutdown(): void {
    if (this.done) return;
    this.end();
    this.runCancel();
  }

  private runCancel(): void {
    const cb = this.onCancel;
    this.onCancel = undefined;
    cb?.();
  }

  /** Resolves true after `ms`, or false as soon as the request is cancelled. */
  wait(ms: number): Promise<boolean> {
    if (this.done) return Promise.resolve(false);
    if (ms <= 0) return Promise.resolve(true);
    return new Promise<boolean>((resolve) => {
      this.onCancel = () => resolve(false);
      this.setTimeout(() => {
        this.timeout = undefined;
        this.onCancel = undefined;
        resolve(true);
      }, ms);
    });
  }
}
