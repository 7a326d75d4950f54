/**
 * The chat -> Responses event translation as a pure state machine: chat SSE
 * payloads in, Responses SSE text out, no I/O (events.ts wraps it in a
 * stream). Each input payload yields its events at once; nothing is held
 * back for later input, so the client sees a token when the upstream sent it.
 * A plain text or reasoning delta is taken as bytes and written as bytes
 * (`plainText`: its text is never decoded on the way; which chunks are such
 * deltas is read from their bytes in chunk-match.ts); every other chunk as
 * a string.
 *
 * Items follow the order the upstream's deltas open them: a `reasoning` item
 * for `reasoning_content`/`reasoning` text, a `message` item for `content`
 * (and `refusal`), a `function_call` item per tool-call index. A reasoning or
 * message item ends when an item of another kind begins (a later delta of
 * the same kind opens a new item); function calls stay open until the choice
 * finishes, because chat may interleave argument deltas of several calls by
 * index. A function_call item is added when its arguments begin (or another
 * item begins, or the choice finishes), not at its name's first piece: some
 * servers stream the name in pieces, and the added event carries it whole.
 * An answer with neither text nor a tool call ends with an empty
 * message, as the JSON answer does. The final event (`response.completed` /
 * `response.incomplete`) waits for `[DONE]`, since the usage chunk comes after
 * the finish_reason chunk.
 */
import type { ByteWriter } from "../lib/byte-writer.ts";
import { isRecord } from "../lib/guards.ts";
import { ARGS_TAIL, argsIndex, argumentsAt, isRoleChunk, PLAIN_TAIL_BYTES, plainTextAt, plainTextDelta, reasoningTextAt } from "./chunk-match.ts";
import { JsonText } from "./json-text.ts";
import {
  argumentsText,
  callIdFor,
  endOf,
  type FunctionCallItem,
  finish,
  type ItemStatus,
  itemId,
  type Logprob,
  logprobsFromChat,
  type MessageItem,
  type OutputRefusal,
  type OutputText,
  type ReasoningItem,
  type ReasoningText,
  type ResponseMeta,
  type ResponseObject,
  type ResponseUsage,
  responseShell,
  usageFromChat,
} from "./output.ts";

/**
 * A message's output_text part while it is open: its text held as JSON string
 * content (part.text is set from it when the part is done, or the answer ends
 * with it open), and the fields every delta event of it carries, written once.
 */
interface OpenText {
  part: OutputText;
  at: number;
  text: JsonText;
  /** `"item_id":"…","output_index":…,"content_index":…` */
  fields: string;
  /** `,` + fields + `,"delta":"`, as bytes (the delta events the upstream's bytes go into). */
  deltaHead: Buffer | undefined;
}
interface OpenMessage {
  item: MessageItem;
  index: number;
  text?: OpenText;
  refusal?: { part: OutputRefusal; at: number };
}
/** A reasoning item while it is open: its text held as JSON string content, as an open output_text part's (OpenText). */
interface OpenReasoning {
  item: ReasoningItem;
  index: number;
  part: ReasoningText;
  text: JsonText;
  /** `,"item_id":"…","output_index":…,"content_index":0,"delta":"`, as bytes (the delta events the upstream's bytes go into). */
  deltaHead: Buffer | undefined;
}
interface Call {
  callId: string | undefined;
  name: string;
  /** Argument text received before the item is added (once its name and its arguments have both begun). */
  pending: string;
  item?: FunctionCallItem;
  index: number;
  done: boolean;
  /**
   * The arguments once the item is added, held as JSON string content as an open text part's are (item.arguments
   * is set from it for the done events and any Response built while the call is open).
   */
  args: JsonText | undefined;
  /** `,"item_id":"…","output_index":…,"delta":"`, as bytes (the delta events the upstream's bytes go into). */
  deltaHead: Buffer | undefined;
}

/** The call's arguments held (made with the first piece after its item is added). */
function argsOf(call: Call): JsonText {
  let a = call.args;
  if (!a) {
    a = new JsonText();
    call.args = a;
  }
  return a;
}

/** One chat tool-call index per call; more than this in one answer is not a model talking. */
const MAX_CALLS = 128;

const str = (v: unknown): string => (typeof v === "string" ? v : "");
const q = JSON.stringify;

/** Logprobs as the text delta and done events carry them (the SDK's event types: no bytes). */
function eventLogprobs(lps: Logprob[] | undefined): string {
  if (!lps || lps.length === 0) return "[]";
  return q(lps.map((l) => ({ token: l.token, logprob: l.logprob, top_logprobs: l.top_logprobs.map((t) => ({ token: t.token, logprob: t.logprob })) })));
}

/** What a text delta event holds before its sequence number. */
const TEXT_DELTA_START = Buffer.from('event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":');
/** And after its delta's content (a delta taken from the upstream's bytes has no logprobs). */
const TEXT_DELTA_END = Buffer.from('","logprobs":[]}\n\n');
/** A reasoning delta event, before its sequence number and after its delta's content. */
const REASONING_DELTA_START = Buffer.from('event: response.reasoning_text.delta\ndata: {"type":"response.reasoning_text.delta","sequence_number":');
const REASONING_DELTA_END = Buffer.from('"}\n\n');
/** A function call's arguments delta event, before its sequence number (it ends as a reasoning delta event does). */
const ARGS_DELTA_START = Buffer.from('event: response.function_call_arguments.delta\ndata: {"type":"response.function_call_arguments.delta","sequence_number":');

export class ChatToResponses {
  /**
   * The output items so far. The response frame around them (id, the echoed
   * request fields, status) is built only when an event carries it (created,
   * in_progress, the final one): an open stream holds its items, not a frame.
   */
  private readonly output: ResponseObject["output"] = [];
  /** Set once the final event has been produced. */
  final: ResponseObject | undefined;
  private seq = 0;
  private out = "";
  private msg: OpenMessage | undefined;
  private rs: OpenReasoning | undefined;
  /** The answer's tool calls by chat index: made with its first call (most answers have none). */
  private calls: Map<number, Call> | undefined;
  /** The call_ids given so far (at most MAX_CALLS): each call of the answer has its own. */
  private callIds: Set<string> | undefined;
  private finishReason: unknown = null;
  private usage: ResponseUsage | undefined;

  constructor(private readonly meta: ResponseMeta) {}

  /** The Response as it stands, in a new frame. */
  private frame(status: ResponseObject["status"]): ResponseObject {
    return responseShell(this.meta, status, this.output);
  }

  private emit(type: string, body: string): void {
    this.out += `event: ${type}\ndata: {"type":"${type}","sequence_number":${this.seq++},${body}}\n\n`;
  }

  private take(): string {
    const s = this.out;
    this.out = "";
    return s;
  }

  /**
   * An upstream keep-alive (an SSE event of comments only): a comment, in its
   * place among the events, so that a proxy or client between us and the
   * user does not drop a connection that is silent while the model thinks.
   * Not an event: no sequence_number (the SDKs skip comments). None after the final event.
   */
  comment(): string {
    return this.final ? "" : ": keep-alive\n\n";
  }

  /**
   * `response.created` and `response.in_progress`, sent before the upstream's
   * first chunk is read: the Response serialised once, both events written in
   * one string (as emit would write them).
   */
  start(): string {
    const snapshot = q(this.frame("in_progress"));
    const created = this.seq++;
    const inProgress = this.seq++;
    return `${this.take()}event: response.created\ndata: {"type":"response.created","sequence_number":${created},"response":${snapshot}}\n\nevent: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":${inProgress},"response":${snapshot}}\n\n`;
  }

  /** One chat SSE `data:` payload (`[DONE]`, a chunk, or the gateway's error event) -> the Responses events it causes. */
  data(payload: string): string {
    if (this.final) return "";
    if (payload === "[DONE]") {
      this.complete();
      return this.take();
    }
    if (this.finishReason === null) {
      const text = plainTextDelta(payload);
      if (text !== undefined) {
        if (text !== "") this.textDelta(text, undefined);
        return this.take();
      }
    }
    let v: unknown;
    try {
      v = JSON.parse(payload);
    } catch {
      return this.fail("The model sent an unreadable stream.", null);
    }
    if (!isRecord(v)) return "";
    if (isRecord(v.error) || v.object === "error") {
      const e = isRecord(v.error) ? v.error : v;
      return this.fail(str(e.message) || "The model failed while generating.", typeof e.code === "string" ? e.code : null);
    }
    if (isRecord(v.usage)) this.usage = usageFromChat(v.usage);
    if (Array.isArray(v.choices)) {
      for (const c of v.choices) if (isRecord(c) && (c.index ?? 0) === 0) this.choice(c);
    }
    return this.take();
  }

  private choice(c: Record<string, unknown>): void {
    if (this.finishReason !== null) return;
    const d = isRecord(c.delta) ? c.delta : {};
    const reasoning = str(d.reasoning_content) || str(d.reasoning);
    if (reasoning) this.reasoningDelta(reasoning);
    const content = str(d.content);
    if (content) this.textDelta(content, c.logprobs == null ? undefined : logprobsFromChat(c.logprobs));
    const refusal = str(d.refusal);
    if (refusal) this.refusalDelta(refusal);
    if (Array.isArray(d.tool_calls)) {
      d.tool_calls.forEach((tc, i) => {
        if (isRecord(tc)) this.toolCallDelta(tc, i);
      });
    }
    if (typeof c.finish_reason === "string") {
      this.finishReason = c.finish_reason;
      this.closeAll(this.itemStatus());
    }
  }

  private itemStatus(): ItemStatus {
    return endOf(this.finishReason).status === "completed" ? "completed" : "incomplete";
  }

  private addItem(item: MessageItem | ReasoningItem | FunctionCallItem): number {
    const index = this.output.length;
    this.output.push(item);
    this.emit("response.output_item.added", `"output_index":${index},"item":${q(item)}`);
    return index;
  }

  /** The open reasoning item, opened (and a message before it ended) if there is none. */
  private openReasoning(): OpenReasoning {
    this.closeMessage("completed");
    if (!this.rs) {
      this.addHeld();
      const item: ReasoningItem = { type: "reasoning", id: itemId("rs"), summary: [], content: [], status: "in_progress" };
      const index = this.addItem(item);
      const part: ReasoningText = { type: "reasoning_text", text: "" };
      item.content.push(part);
      this.emit("response.content_part.added", `"item_id":"${item.id}","output_index":${index},"content_index":0,"part":${q(part)}`);
      this.rs = { item, index, part, text: new JsonText(), deltaHead: undefined };
    }
    return this.rs;
  }

  private reasoningDelta(delta: string): void {
    const { item, index, text } = this.openReasoning();
    const quoted = q(delta);
    text.appendQuoted(quoted);
    this.emit("response.reasoning_text.delta", `"item_id":"${item.id}","output_index":${index},"content_index":0,"delta":${quoted}`);
  }

  private openMessage(): OpenMessage {
    this.closeReasoning("completed");
    if (!this.msg) {
      this.addHeld();
      const item: MessageItem = { type: "message", id: itemId("msg"), status: "in_progress", role: "assistant", content: [] };
      this.msg = { item, index: this.addItem(item) };
    }
    return this.msg;
  }

  private textPart(m: OpenMessage): OpenText {
    if (!m.text) {
      const part: OutputText = { type: "output_text", text: "", annotations: [], logprobs: [] };
      const at = m.item.content.length;
      m.text = { part, at, text: new JsonText(), fields: `"item_id":"${m.item.id}","output_index":${m.index},"content_index":${at}`, deltaHead: undefined };
      m.item.content.push(part);
      this.emit("response.content_part.added", `${m.text.fields},"part":${q(part)}`);
    }
    return m.text;
  }

  private textDelta(delta: string, logprobs: Logprob[] | undefined): void {
    const text = this.textPart(this.openMessage());
    const quoted = q(delta);
    text.text.appendQuoted(quoted);
    if (logprobs && logprobs.length > 0) for (const lp of logprobs) text.part.logprobs.push(lp);
    this.emit("response.output_text.delta", `${text.fields},"delta":${quoted},"logprobs":${eventLogprobs(logprobs)}`);
  }

  /**
   * One whole SSE event's data, b[from..to), when it is a plain text delta
   * whose text the upstream escaped as JSON.stringify would (`plainTextAt`),
   * or a plain reasoning delta likewise (`reasoningTextAt`): its events are
   * written to `out` (those already queued first), the text going from the
   * upstream's bytes to the event's without being decoded, and true. False,
   * with nothing written, for any other chunk (`data` reads it).
   */
  plainText(b: Buffer, from: number, to: number, out: ByteWriter): boolean {
    if (this.final || this.finishReason !== null) return false;
    const start = plainTextAt(b, from, to);
    if (start === -1) return this.plainReasoning(b, from, to, out);
    const end = to - PLAIN_TAIL_BYTES.length;
    if (start === end) return true;
    const text = this.textPart(this.openMessage());
    text.text.appendContent(b, start, end);
    // The item and part it opened (and the end of a reasoning item before it) go first.
    out.string(this.take());
    text.deltaHead ??= Buffer.from(`,${text.fields},"delta":"`);
    this.deltaEvent(out, TEXT_DELTA_START, text.deltaHead, b, start, end, TEXT_DELTA_END);
    return true;
  }

  /** `plainText` for a plain reasoning delta (`reasoningTextAt`): its text goes from the upstream's bytes to the event's as well. */
  private plainReasoning(b: Buffer, from: number, to: number, out: ByteWriter): boolean {
    const start = reasoningTextAt(b, from, to);
    // The role chunk: nothing to write, and nothing decoded to find that out.
    if (start === -1) return this.plainArguments(b, from, to, out) || isRoleChunk(b, from, to);
    const end = to - PLAIN_TAIL_BYTES.length;
    // An empty reasoning delta opens nothing, as `choice` reads it.
    if (start === end) return true;
    const r = this.openReasoning();
    r.text.appendContent(b, start, end);
    // The item and part it opened (and the end of a message before it) go first.
    out.string(this.take());
    r.deltaHead ??= Buffer.from(`,"item_id":"${r.item.id}","output_index":${r.index},"content_index":0,"delta":"`);
    this.deltaEvent(out, REASONING_DELTA_START, r.deltaHead, b, start, end, REASONING_DELTA_END);
    return true;
  }

  /**
   * `plainText` for a plain argument delta (`argumentsAt`) of a call whose item is added: its arguments go from the
   * upstream's bytes to the event's as well. Any other (a call not yet added, a name, an id) is decoded.
   */
  private plainArguments(b: Buffer, from: number, to: number, out: ByteWriter): boolean {
    const start = argumentsAt(b, from, to);
    if (start === -1) return false;
    const call = this.calls?.get(argsIndex);
    const item = call?.item;
    if (!call || !item) return false;
    const end = to - ARGS_TAIL.length;
    // An empty piece: no event, as `toolCallDelta` reads it.
    if (start === end) return true;
    argsOf(call).appendContent(b, start, end);
    out.string(this.take());
    call.deltaHead ??= Buffer.from(`,"item_id":"${item.id}","output_index":${call.index},"delta":"`);
    this.deltaEvent(out, ARGS_DELTA_START, call.deltaHead, b, start, end, REASONING_DELTA_END);
    return true;
  }

  /** A delta event written as bytes: its start, its sequence number, the part's fields, the upstream's text bytes b[from..to), its end. */
  private deltaEvent(out: ByteWriter, head: Buffer, fields: Buffer, b: Buffer, from: number, to: number, tail: Buffer): void {
    out.bytes(head);
    out.int(this.seq++);
    out.bytes(fields);
    out.bytes(b, from, to);
    out.bytes(tail);
  }

  /** The call's item.arguments from the arguments held, for its done events and any Response built while it is open. */
  private settleArguments(call: Call): void {
    if (call.item && call.args && call.args.byteLength > 0) call.item.arguments = call.args.text();
  }

  /** part.text from the text held, for the done events and any Response built while the part is open. */
  private settleText(m: OpenMessage | undefined): void {
    const t = m?.text;
    if (t && t.text.byteLength > 0) t.part.text = t.text.text();
  }

  /** The reasoning's part.text from the text held, likewise. */
  private settleReasoning(r: OpenReasoning | undefined): void {
    if (r && r.text.byteLength > 0) r.part.text = r.text.text();
  }

  private refusalDelta(delta: string): void {
    const m = this.openMessage();
    if (!m.refusal) {
      const part: OutputRefusal = { type: "refusal", refusal: "" };
      m.refusal = { part, at: m.item.content.length };
      m.item.content.push(part);
      this.emit("response.content_part.added", `"item_id":"${m.item.id}","output_index":${m.index},"content_index":${m.refusal.at},"part":${q(part)}`);
    }
    m.refusal.part.refusal += delta;
    this.emit("response.refusal.delta", `"item_id":"${m.item.id}","output_index":${m.index},"content_index":${m.refusal.at},"delta":${q(delta)}`);
  }

  private toolCallDelta(tc: Record<string, unknown>, position: number): void {
    const key = typeof tc.index === "number" && Number.isSafeInteger(tc.index) ? tc.index : position;
    this.calls ??= new Map();
    const calls = this.calls;
    let call = calls.get(key);
    if (!call) {
      if (calls.size >= MAX_CALLS) return;
      call = { callId: undefined, name: "", pending: "", index: -1, done: false, args: undefined, deltaHead: undefined };
      calls.set(key, call);
    }
    const fn = isRecord(tc.function) ? tc.function : {};
    if (typeof tc.id === "string" && tc.id !== "") call.callId ??= tc.id;
    const args = argumentsText(fn.arguments);
    const name = str(fn.name);
    if (!call.item) {
      call.name += name;
      call.pending += args;
      // The item is added once its arguments begin (or another item does): a name sent in pieces is whole by then (decisions.md).
      if (call.name !== "" && call.pending !== "") this.openCall(call);
      return;
    }
    // A piece of the name after the arguments began: the added event had the name as it stood; the done events and the Response have it whole.
    call.item.name += name;
    if (args) {
      const quoted = q(args);
      argsOf(call).appendQuoted(quoted);
      this.emit("response.function_call_arguments.delta", `"item_id":"${call.item.id}","output_index":${call.index},"delta":${quoted}`);
    }
  }

  /** The call's item, made (not yet in the output). */
  private callItem(call: Call): FunctionCallItem {
    this.callIds ??= new Set();
    const item: FunctionCallItem = {
      type: "function_call",
      id: itemId("fc"),
      call_id: callIdFor(call.callId, this.callIds),
      name: call.name,
      arguments: "",
      status: "in_progress",
    };
    call.item = item;
    return item;
  }

  /**
   * The calls held back (a name, no arguments yet) that came before `upTo` (all of them without it) are
   * added, with their names as they stand: before another item, so that items keep the order the answer
   * began them in.
   */
  private addHeld(upTo?: Call): void {
    if (!this.calls) return;
    for (const c of this.calls.values()) {
      if (c === upTo) return;
      if (!c.item && c.name !== "") this.openCall(c);
    }
  }

  private openCall(call: Call): void {
    this.addHeld(call);
    this.closeReasoning("completed");
    this.closeMessage("completed");
    const item = this.callItem(call);
    call.index = this.addItem(item);
    if (call.pending) {
      const quoted = q(call.pending);
      argsOf(call).appendQuoted(quoted);
      this.emit("response.function_call_arguments.delta", `"item_id":"${item.id}","output_index":${call.index},"delta":${quoted}`);
      call.pending = "";
    }
  }

  private closeReasoning(status: ItemStatus): void {
    const r = this.rs;
    if (!r) return;
    this.rs = undefined;
    this.settleReasoning(r);
    const at = `"item_id":"${r.item.id}","output_index":${r.index},"content_index":0`;
    this.emit("response.reasoning_text.done", `${at},"text":${q(r.part.text)}`);
    this.emit("response.content_part.done", `${at},"part":${q(r.part)}`);
    r.item.status = status;
    this.emit("response.output_item.done", `"output_index":${r.index},"item":${q(r.item)}`);
  }

  private closeMessage(status: ItemStatus): void {
    const m = this.msg;
    if (!m) return;
    this.msg = undefined;
    this.settleText(m);
    const id = `"item_id":"${m.item.id}","output_index":${m.index}`;
    const content = m.item.content;
    for (let i = 0; i < content.length; i++) {
      const part = content[i] as OutputText | OutputRefusal;
      if (part.type === "output_text") this.emit("response.output_text.done", `${id},"content_index":${i},"text":${q(part.text)},"logprobs":${eventLogprobs(part.logprobs)}`);
      else this.emit("response.refusal.done", `${id},"content_index":${i},"refusal":${q(part.refusal)}`);
      this.emit("response.content_part.done", `${id},"content_index":${i},"part":${q(part)}`);
    }
    m.item.status = status;
    this.emit("response.output_item.done", `"output_index":${m.index},"item":${q(m.item)}`);
  }

  private closeAll(status: ItemStatus): void {
    this.closeReasoning(status);
    // An answer with no text and no tool call (empty, or reasoning only) still ends with a message
    // with empty text, as the JSON answer does (output.ts): the Agents SDK takes that as the final
    // output, where an answer with no message would make it ask the model again.
    const calls = this.calls;
    if (!calls && !this.msg && !this.hasMessage()) this.textPart(this.openMessage());
    this.closeMessage(status);
    if (!calls) return;
    // A call whose name never came is still reported, rather than losing its arguments.
    for (const call of calls.values()) if (!call.item) this.openCall(call);
    const open = [...calls.values()].filter((c) => !c.done).sort((a, b) => a.index - b.index);
    for (const call of open) {
      const item = call.item;
      if (!item) continue;
      call.done = true;
      this.settleArguments(call);
      this.emit("response.function_call_arguments.done", `"item_id":"${item.id}","output_index":${call.index},"name":${q(item.name)},"arguments":${q(item.arguments)}`);
      item.status = status;
      this.emit("response.output_item.done", `"output_index":${call.index},"item":${q(item)}`);
    }
  }

  private hasMessage(): boolean {
    for (let i = 0; i < this.output.length; i++) if (this.output[i]?.type === "message") return true;
    return false;
  }

  /** `[DONE]`: the answer is whole. */
  private complete(): void {
    if (this.finishReason === null) this.closeAll("completed");
    const end = endOf(this.finishReason);
    const r = finish(this.frame(end.status), end.status, { incomplete: end.incomplete, usage: this.usage });
    this.final = r;
    this.emit(end.status === "completed" ? "response.completed" : "response.incomplete", `"response":${q(r)}`);
  }

  /** Items still open when the answer stops short: reported as incomplete, without their done events. */
  private markOpenIncomplete(): void {
    this.settleText(this.msg);
    this.settleReasoning(this.rs);
    // A call whose name came but whose arguments had not begun (its item not yet added) is in the output, as the rest.
    if (this.calls) {
      for (const call of this.calls.values()) {
        this.settleArguments(call);
        if (call.item || call.name === "") continue;
        call.index = this.output.length;
        this.output.push(this.callItem(call));
      }
    }
    for (const item of this.output) if (item.status === "in_progress") item.status = "incomplete";
  }

  /**
   * The chat stream failed (its error event, or it broke off): `response.failed`
   * with what was generated so far, then an `error` event, which the SDKs raise
   * as an APIError as they do for chat's error event.
   */
  fail(message: string, code: string | null): string {
    if (this.final) return "";
    this.markOpenIncomplete();
    const r = finish(this.frame("failed"), "failed", { usage: this.usage, error: message });
    this.final = r;
    this.emit("response.failed", `"response":${q(r)}`);
    this.emit("error", `"code":${q(code ?? "server_error")},"message":${q(message)},"param":null`);
    return this.take();
  }

  /**
   * The client went away: the Response as it stood, `cancelled`. No events (nobody reads them). Its usage
   * is `usage` when given (what the request is charged: the relay may have read the upstream's usage
   * chunk after the client left), else the last report seen.
   */
  cancel(usage?: ResponseUsage): ResponseObject {
    if (this.final) return this.final;
    this.markOpenIncomplete();
    const r = finish(this.frame("cancelled"), "cancelled", { usage: usage ?? this.usage });
    this.final = r;
    return r;
  }
}
