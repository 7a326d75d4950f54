/**
 * A bounded memory of keys already seen, for things done once per key in a
 * process (a log line about a row that breaks the rules: docs/decisions.md,
 * "Rows read from the database"). `first(key)` is true the first time a key
 * is seen; when `max` keys are held they are all forgotten, so a process that
 * meets endless odd rows neither grows without bound nor goes silent.
 */
export function firstSeen(max = 10_000): (key: string) => boolean {
  const seen = new Set<string>();
  return (key) => {
    if (seen.has(key)) return false;
    if (seen.size >= max) seen.clear();
    seen.add(key);
    return true;
  };
}
