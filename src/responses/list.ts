import { AppError } from "../lib/errors.ts";
import { isRecord } from "../lib/guards.ts";
import type { StoredItem } from "./translate.ts";

/**
 * GET /v1/responses/{id}/input_items: OpenAI's cursor-paged list shape
 * (`data`, `first_id`, `last_id`, `has_more`). `order` is desc (newest first)
 * by default; `after`/`before` are item ids of the list in that order;
 * `limit` 1..100, default 20 (with `before`: the page just before it). `include` is accepted and has no effect.
 * Items are listed in the SDK's item shapes (`listed`).
 */

export interface ItemList {
  object: "list";
  data: StoredItem[];
  first_id: string | null;
  last_id: string | null;
  has_more: boolean;
}

/** An assistant message's part as the SDK's ResponseOutputMessage has it: output_text (with annotations) or refusal. */
function assistantPart(p: unknown): unknown {
  if (!isRecord(p) || (p.type !== "output_text" && p.type !== "input_text")) return p;
  if (p.type === "output_text" && Array.isArray(p.annotations)) return p;
  return { ...p, type: "output_text", annotations: Array.isArray(p.annotations) ? p.annotations : [] };
}

/** A user, system or developer part as the SDK's ResponseInputImage has it: an image always with its detail. */
const inputPart = (p: unknown): unknown => (isRecord(p) && p.type === "input_image" && p.detail == null ? { ...p, detail: "auto" } : p);

/**
 * A stored input item in the shape of the SDK's item types, filling what the
 * request could leave out (the gateway accepts more than those types require):
 * an image's `detail` (auto, its default), a reasoning item's `summary`, an
 * assistant text part's `annotations` (and its `input_text` parts as
 * `output_text`). Done when listed, so the stored items (replayed upstream by
 * previous_response_id) stay as sent, and rows written earlier list the same.
 */
export function listed(item: StoredItem): StoredItem {
  if (item.type === "reasoning") return Array.isArray(item.summary) ? item : { ...item, summary: [] };
  if (item.type !== "message" || !Array.isArray(item.content)) return item;
  const part = item.role === "assistant" ? assistantPart : inputPart;
  const content = item.content.map(part);
  return content.every((p, k) => p === (item.content as unknown[])[k]) ? item : { ...item, content };
}

function bad(param: string, message: string): AppError {
  return new AppError("invalid_request_error", message, param);
}

function position(items: readonly StoredItem[], id: string, param: string): number {
  const i = items.findIndex((it) => it.id === id);
  if (i < 0) throw bad(param, `'${param}': no input item with id '${id}' in this response.`);
  return i;
}

/** The parameters that take one value (include may repeat: include=a&include=b). */
const SINGLE = ["order", "limit", "after", "before"] as const;

/** A whole number in decimal digits (leading zeros allowed: 050 is 50, as 0050 is), no sign, point or exponent. */
const DIGITS = /^\d+$/;

export function listItems(all: readonly StoredItem[], search: URLSearchParams): ItemList {
  const query: Partial<Record<(typeof SINGLE)[number], string>> = {};
  for (const name of SINGLE) {
    const values = search.getAll(name);
    if (values.length > 1) throw bad(name, `Invalid value for '${name}': given more than once.`);
    if (values.length === 1) query[name] = values[0];
  }
  const order = query.order ?? "desc";
  if (order !== "asc" && order !== "desc") throw bad("order", "Invalid value for 'order': expected asc or desc.");
  const rawLimit = query.limit ?? "20";
  if (!DIGITS.test(rawLimit) || Number(rawLimit) < 1 || Number(rawLimit) > 100) {
    throw bad("limit", "Invalid value for 'limit': expected an integer from 1 to 100.");
  }
  const limit = Number(rawLimit);
  let items = order === "asc" ? [...all] : [...all].reverse();
  if (query.after !== undefined) items = items.slice(position(items, query.after, "after") + 1);
  let data: StoredItem[];
  let hasMore: boolean;
  if (query.before !== undefined) {
    // The page that ends just before the cursor (paging backwards); has_more: there are items before this page.
    const end = position(items, query.before, "before");
    data = items.slice(Math.max(0, end - limit), end);
    hasMore = end > limit;
  } else {
    data = items.slice(0, limit);
    hasMore = items.length > limit;
  }
  return { object: "list", data: data.map(listed), first_id: data[0]?.id ?? null, last_id: data[data.length - 1]?.id ?? null, has_more: hasMore };
}
