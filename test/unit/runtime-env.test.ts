import { expect, test } from "bun:test";
import { runtimeEnvWarning } from "../../src/lib/runtime-env.ts";

test("the allocator warning: only when MIMALLOC_PURGE_HOLES is unset, naming the variable and how to set it", () => {
  const warning = runtimeEnvWarning({});
  expect(warning).toContain("MIMALLOC_PURGE_HOLES");
  expect(warning).toContain("MIMALLOC_PURGE_HOLES=0");
  // An operator's own choice, either way, is not second-guessed.
  expect(runtimeEnvWarning({ MIMALLOC_PURGE_HOLES: "0" })).toBeUndefined();
  expect(runtimeEnvWarning({ MIMALLOC_PURGE_HOLES: "1" })).toBeUndefined();
  // Empty is unset, for the README and for the allocator (which then keeps its default, purge_holes 1).
  expect(runtimeEnvWarning({ MIMALLOC_PURGE_HOLES: "" })).toBe(warning);
});
