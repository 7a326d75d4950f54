/**
 * Preloaded by bunfig.toml. Note for test authors: in Bun 1.4.5 a
 * setDefaultTimeout here applies to the first test file only, so every slow
 * test file sets its own (`setDefaultTimeout(30_000)` after its imports).
 */
export {};
