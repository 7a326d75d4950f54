/**
 * Whether `p` resolves within `ms` (true) or the time runs out first (false);
 * its rejection, if first, is passed on. The timer is cleared either way. For
 * the bounded waits of a stop (drain flush, unsettled calls, stored responses),
 * where what is still pending is let run on its own.
 */
export async function resolvesWithin(p: Promise<unknown>, ms: number): Promise<boolean> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  try {
    return await Promise.race([
      p.then(() => true),
      new Promise<boolean>((resolve) => {
        timer = setTimeout(() => resolve(false), ms);
      }),
    ]);
  } finally {
    clearTimeout(timer);
  }
}
