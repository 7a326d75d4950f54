/**
 * Per-target circuit breaker. `failures` consecutive failures open it for
 * `cooldownMs`; after that one request (the probe) may go through while others
 * keep skipping the target; the probe's result closes or re-opens it.
 * Pure state plus a clock, so tests drive it without sleeping.
 */

export type BreakerState = "closed" | "open" | "half-open";

export interface BreakerOptions {
  failures: number;
  cooldownMs: number;
}

export class Breaker {
  private consecutive = 0;
  private openUntil = 0;
  private opened = false;
  private probing = false;

  constructor(private readonly opts: BreakerOptions) {}

  state(now: number): BreakerState {
    if (!this.opened) return "closed";
    return now < this.openUntil ? "open" : "half-open";
  }

  /** Whether a request may use the target now (a half-open breaker admits one probe at a time). */
  available(now: number): boolean {
    const s = this.state(now);
    return s === "closed" || (s === "half-open" && !this.probing);
  }

  /** Marks the start of a request; in half-open state that request becomes the probe. */
  acquire(now: number): void {
    if (this.state(now) === "half-open") this.probing = true;
  }

  success(): void {
    this.consecutive = 0;
    this.opened = false;
    this.probing = false;
  }

  /** Returns true when this failure opened (or re-opened) the breaker. */
  failure(now: number): boolean {
    this.consecutive++;
    if (this.probing || (!this.opened && this.consecutive >= this.opts.failures)) {
      this.opened = true;
      this.probing = false;
      this.openUntil = now + this.opts.cooldownMs;
      return true;
    }
    return false;
  }

  /** The request ended without a verdict on the target (client left); let another probe go. */
  release(): void {
    this.probing = false;
  }
}
