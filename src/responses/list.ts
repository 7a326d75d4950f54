import { AppError } from "../lib/errors.ts";
import type { StoredItem } from "./translate.ts";

/**
 * GET /v1/responses/{id}/input_items: OpenAI's cursor-paged list shape
 * (`data`, `first_id`, `last_id`, `has_more`). `order` is desc (newest first)
 * by default; `after`/`before` are item ids of the list in that order;
 * `limit` 1..100, default 20 (with `before`: the page just before it). `include` is accepted and has no effect.
 */

export interface ItemList {
  object: "list";
  data: StoredItem[];
  first_id: string | null;
  last_id: string | null;
  has_more: boolean;
}

function bad(param: string, message: string): AppError {
  return new AppError("invalid_request_error", message, param);
}

function position(items: readonly StoredItem[], id: string, param: string): number {
  const i = items.findIndex((it) => it.id === id);
  if (i < 0) throw bad(param, `'${param}': no input item with id '${id}' in this response.`);
  return i;
}

export function listItems(all: readonly StoredItem[], query: Record<string, string | undefined>): ItemList {
  const order = query.order ?? "desc";
  if (order !== "asc" && order !== "desc") throw bad("order", "Invalid value for 'order': expected asc or desc.");
  const rawLimit = query.limit ?? "20";
  if (!/^\d{1,3}$/.test(rawLimit) || Number(rawLimit) < 1 || Number(rawLimit) > 100) {
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
  return { object: "list", data, first_id: data[0]?.id ?? null, last_id: data[data.length - 1]?.id ?? null, has_more: hasMore };
}
