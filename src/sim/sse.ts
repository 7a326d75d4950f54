/**
 * Pre-encoded SSE fragments. A chunk on the wire is `prefix + tail`, where the
 * prefix (id/created/model) is encoded once per stream and tails are shared
 * across all streams, so each emitted chunk costs exactly one allocation.
 */

import { enc } from "./wire.ts";

const TAIL_OPEN = ',"logprobs":null,"finish_reason":';
export const ROLE_TAIL = enc.encode(`{"role":"assistant","content":""}${TAIL_OPEN}null}]}\n\n`);
export const DONE_BYTES = enc.encode("data: [DONE]\n\n");
export const MALFORMED_BYTES = enc.encode("data: {not json\n\n");

export const tokenText = (i: number): string => `token${i} `;
const contentTails: Uint8Array[] = [];
export function contentTail(i: number): Uint8Array {
  let t = contentTails[i];
  if (t === undefined) {
    t = enc.encode(`{"content":"${tokenText(i)}"}${TAIL_OPEN}null}]}\n\n`);
    contentTails[i] = t;
  }
  return t;
}

const finishTails = new Map<string, Uint8Array>();
export function finishTail(reason: string): Uint8Array {
  let t = finishTails.get(reason);
  if (t === undefined) {
    t = enc.encode(`{}${TAIL_OPEN}"${reason}"}]}\n\n`);
    finishTails.set(reason, t);
  }
  return t;
}

export function deltaTail(delta: unknown): Uint8Array {
  return enc.encode(`${JSON.stringify(delta)}${TAIL_OPEN}null}]}\n\n`);
}
