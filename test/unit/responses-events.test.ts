import { describe, expect, test } from "bun:test";
import { responseEventStream, responsesTransform } from "../../src/responses/events.ts";
import { plainTextDelta } from "../../src/responses/chunk-match.ts";
import { type ResponseObject, responseFromChat } from "../../src/responses/output.ts";
import { until } from "../helpers/poll.ts";
import { chunkText, cut, SPEC_ROWS } from "../helpers/sse-spec.ts";
import { chunk, DONE, ERROR, enc, meta, ROLE, source, USAGE } from "../helpers/responses.ts";

interface Ev {
  type: string;
  sequence_number: number;
  [k: string]: unknown;
}

/** Parses Responses SSE text, checking each event's `event:` line against its `type`. */
function parseEvents(text: string): Ev[] {
  expect(text.endsWith("\n\n")).toBe(true);
  return text
    .slice(0, -2)
    .split("\n\n")
    .map((block) => {
      const [eventLine, dataLine, ...rest] = block.split("\n");
      expect(rest).toEqual([]);
      const ev = JSON.parse(String(dataLine).replace(/^data: /, "")) as Ev;
      expect(eventLine).toBe(`event: ${ev.type}`);
      return ev;
    });
}

async function translate(parts: (string | Uint8Array)[]) {
  const { stream, state } = source(parts.map((p) => (typeof p === "string" ? enc.encode(p) : p)));
  const finals: ResponseObject[] = [];
  const out = await new Response(responseEventStream(stream, meta(), (r) => {
      finals.push(r);
    })).text();
  const events = parseEvents(out);
  expect(events.map((e) => e.sequence_number)).toEqual(events.map((_, i) => i));
  return { events, finals, state };
}

/** Item ids are random: the same stream split differently must give the same events up to them. */
const normalise = (events: Ev[]) => JSON.parse(JSON.stringify(events).replace(/"(msg|fc|rs)_[0-9a-f]+"/g, '"$1_x"').replace(/"completed_at":\d+/g, '"completed_at":0'));

describe("responseEventStream: the event sequence", () => {
  test("a text answer: created, in_progress, item and part added, deltas, dones, completed with usage", async () => {
    const { events, finals, state } = await translate([ROLE, chunk({ content: "Hel" }), chunk({ content: "lo" }), chunk({}, "stop"), USAGE, DONE]);
    expect(events.map((e) => e.type)).toEqual([
      "response.created",
      "response.in_progress",
      "response.output_item.added",
      "response.content_part.added",
      "response.output_text.delta",
      "response.output_text.delta",
      "response.output_text.done",
      "response.content_part.done",
      "response.output_item.done",
      "response.completed",
    ]);
    const [created, , added, part, d1, d2, textDone, partDone, itemDone, completed] = events;
    expect(created?.response).toMatchObject({ id: "resp_test1", object: "response", status: "in_progress", output: [], model: "chat-small", completed_at: null });
    expect(created?.response).not.toHaveProperty("usage");
    const id = String((added?.item as { id?: string } | undefined)?.id);
    expect(id).toMatch(/^msg_/);
    expect(added).toEqual({ type: "response.output_item.added", sequence_number: 2, output_index: 0, item: { type: "message", id, status: "in_progress", role: "assistant", content: [] } });
    expect(part).toEqual({
      type: "response.content_part.added",
      sequence_number: 3,
      item_id: id,
      output_index: 0,
      content_index: 0,
      part: { type: "output_text", text: "", annotations: [], logprobs: [] },
    });
    expect(d1).toEqual({ type: "response.output_text.delta", sequence_number: 4, item_id: id, output_index: 0, content_index: 0, delta: "Hel", logprobs: [] });
    expect(d2?.delta).toBe("lo");
    expect(textDone).toMatchObject({ item_id: id, output_index: 0, content_index: 0, text: "Hello", logprobs: [] });
    expect(partDone).toMatchObject({ item_id: id, part: { type: "output_text", text: "Hello", annotations: [], logprobs: [] } });
    expect(itemDone?.item).toEqual({ type: "message", id, status: "completed", role: "assistant", content: [{ type: "output_text", text: "Hello", annotations: [], logprobs: [] }] });
    const response = completed?.response as ResponseObject;
    expect(response).toMatchObject({ status: "completed", incomplete_details: null, error: null, output: [itemDone?.item], output_text: "Hello" });
    expect(created?.response).toMatchObject({ output_text: "" });
    expect(response.completed_at).toBeNumber();
    expect(response.usage).toEqual({
      input_tokens: 12,
      input_tokens_details: { cached_tokens: 8, cache_write_tokens: 0 },
      output_tokens: 4,
      output_tokens_details: { reasoning_tokens: 0 },
      total_tokens: 16,
    });
    expect(finals).toEqual([response]);
    expect(state.cancelled).toBeUndefined();
  });

  test("split at every byte, and at awkward points (inside UTF-8, CRLF separators, data: without space), the events are the same", async () => {
    const text = ["héllo ", "wörld ✓ ", "🙂", "\\n\"quoted\""];
    const lf = [ROLE, ...text.map((t) => chunk({ content: t })), chunk({}, "stop"), USAGE, DONE].join("");
    const whole = await translate([lf]);
    expect(whole.finals[0]?.output[0]).toMatchObject({ content: [{ text: text.join("") }] });
    const bytes = enc.encode(lf);
    const single = await translate(Array.from(bytes, (b) => Uint8Array.of(b)));
    expect(normalise(single.events)).toEqual(normalise(whole.events));
    // CRLF event ends (sse-starlette servers), `data:` without its space, a comment line, and cuts inside "🙂" and inside "\r\n".
    const crlf = lf.replaceAll("\n\n", "\r\n\r\n").replaceAll("data: ", "data:").replace("data:[DONE]", ": keep-alive\r\ndata: [DONE]");
    const b2 = enc.encode(crlf);
    const emoji = b2.indexOf(0xf0) + 2;
    const cr = b2.indexOf(0x0d) + 1;
    const cuts = [0, 3, cr, emoji, emoji + 1, b2.length - 7, b2.length].sort((a, b) => a - b);
    const pieces = cuts.slice(1).map((end, i) => b2.subarray(cuts[i], end));
    const awkward = await translate(pieces);
    expect(normalise(awkward.events)).toEqual(normalise(whole.events));
    // The deltas are the chat deltas, one event each, not merged or re-cut.
    expect(whole.events.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta)).toEqual(text);
  });

  test("empty deltas (role chunk, empty content, {}) open nothing; the answer ends with one empty message, as the JSON answer has", async () => {
    const { events, finals } = await translate([ROLE, chunk({}), chunk({ content: "" }), chunk({ content: null }), chunk({}, "stop"), DONE]);
    expect(events.map((e) => e.type)).toEqual([
      "response.created",
      "response.in_progress",
      "response.output_item.added",
      "response.content_part.added",
      "response.output_text.done",
      "response.content_part.done",
      "response.output_item.done",
      "response.completed",
    ]);
    expect(finals[0]?.output).toEqual([{ type: "message", id: expect.stringMatching(/^msg_/), status: "completed", role: "assistant", content: [{ type: "output_text", text: "", annotations: [], logprobs: [] }] }]);
  });

  test("the same chat answer streamed and not streamed gives the same output (empty, reasoning only, cut short, text, tool calls)", async () => {
    const answers: [name: string, message: Record<string, unknown>, deltas: Record<string, unknown>[], finish: string][] = [
      ["empty", { content: null }, [], "stop"],
      ["reasoning only", { content: null, reasoning_content: "all thought" }, [{ reasoning_content: "all thought" }], "stop"],
      ["reasoning cut short", { content: "", reasoning_content: "thinking…" }, [{ reasoning_content: "thinking…" }], "length"],
      // Only the item still being written is incomplete (the JSON answer once marked every item so).
      ["text cut short after reasoning", { content: "Hel", reasoning_content: "hm" }, [{ reasoning_content: "hm" }, { content: "Hel" }], "length"],
      [
        "a tool call cut short after text",
        { content: "Checking.", tool_calls: [{ id: "c1", type: "function", function: { name: "f", arguments: '{"a' } }] },
        [{ content: "Checking." }, { tool_calls: [{ index: 0, id: "c1", type: "function", function: { name: "f", arguments: '{"a' } }] }],
        "length",
      ],
      ["text", { content: "hi" }, [{ content: "hi" }], "stop"],
      ["a tool call", { content: null, tool_calls: [{ id: "c1", type: "function", function: { name: "f", arguments: "{}" } }] }, [{ tool_calls: [{ index: 0, id: "c1", type: "function", function: { name: "f", arguments: "{}" } }] }], "tool_calls"],
    ];
    for (const [name, message, deltas, finish] of answers) {
      const streamed = (await translate([ROLE, ...deltas.map((d) => chunk(d)), chunk({}, finish), USAGE, DONE])).finals[0];
      const json = responseFromChat(
        { choices: [{ index: 0, message: { role: "assistant", ...message }, finish_reason: finish }], usage: { prompt_tokens: 12, completion_tokens: 4, total_tokens: 16 } },
        meta(),
      );
      const shape = (r: ResponseObject | undefined) => JSON.parse(JSON.stringify({ status: r?.status, output: r?.output, output_text: r?.output_text }).replace(/"(msg|fc|rs)_[0-9a-f]+"/g, '"$1_x"'));
      expect({ name, ...shape(streamed) }).toEqual({ name, ...shape(json) });
    }
  });

  test("tool-call arguments sent as a JSON object or array are their JSON text, streamed and not; null or a number is no text", async () => {
    // Seen failing before: `str(fn.arguments)` made every one of them "" (output.ts and stream-state.ts).
    const calls = [
      { id: "c1", type: "function", function: { name: "f", arguments: { city: "Oslo", days: [1, 2] } } },
      { id: "c2", type: "function", function: { name: "g", arguments: ["x", { y: true }] } },
      { id: "c3", type: "function", function: { name: "h", arguments: null } },
      { id: "c4", type: "function", function: { name: "k", arguments: 7 } },
    ];
    const expected = ['{"city":"Oslo","days":[1,2]}', '["x",{"y":true}]', "", ""];
    const { events, finals } = await translate([ROLE, chunk({ tool_calls: calls.map((c, index) => ({ index, ...c })) }), chunk({}, "tool_calls"), USAGE, DONE]);
    expect(events.filter((e) => e.type === "response.function_call_arguments.done").map((e) => e.arguments)).toEqual(expected);
    expect(finals[0]?.output.map((i) => (i.type === "function_call" ? i.arguments : i.type))).toEqual(expected);
    const json = responseFromChat({ choices: [{ index: 0, message: { role: "assistant", content: null, tool_calls: calls }, finish_reason: "tool_calls" }] }, meta());
    expect(json.output.map((i) => (i.type === "function_call" ? i.arguments : i.type))).toEqual(expected);
  });

  test("an upstream's comment-only event (a keep-alive) goes out as `: keep-alive` in its place, with no sequence_number; none after the final event", async () => {
    // Seen failing before: SseData ignored comment lines, so the Responses stream dropped them.
    const { stream } = source([ROLE, ": ping\n\n", chunk({ content: "Hi" }), ":\n: two lines\n\n", chunk({}, "stop"), USAGE, DONE, ": late\n\n"].map((p) => enc.encode(p)));
    const out = await new Response(responseEventStream(stream, meta(), () => {})).text();
    const blocks = out.slice(0, -2).split("\n\n");
    const kinds = blocks.map((b) => (b.startsWith(":") ? b : String(/^event: (\S+)/.exec(b)?.[1])));
    expect(kinds).toEqual([
      "response.created",
      "response.in_progress",
      ": keep-alive",
      "response.output_item.added",
      "response.content_part.added",
      "response.output_text.delta",
      ": keep-alive",
      "response.output_text.done",
      "response.content_part.done",
      "response.output_item.done",
      "response.completed",
    ]);
    const events = parseEvents(`${blocks.filter((b) => !b.startsWith(":")).join("\n\n")}\n\n`);
    expect(events.map((e) => e.sequence_number)).toEqual(events.map((_, i) => i));
  });

  test("two tool calls interleaved by index: each delta goes to its own function_call item", async () => {
    const { events, finals } = await translate([
      ROLE,
      chunk({ tool_calls: [{ index: 0, id: "call_A", type: "function", function: { name: "get_weather", arguments: "" } }] }),
      chunk({ tool_calls: [{ index: 1, id: "call_B", type: "function", function: { name: "get_time", arguments: '{"tz"' } }] }),
      chunk({ tool_calls: [{ index: 0, function: { arguments: '{"city":' } }] }),
      chunk({ tool_calls: [{ index: 1, function: { arguments: ':"UTC"}' } }, { index: 0, function: { arguments: '"Oslo"}' } }] }),
      chunk({}, "tool_calls"),
      USAGE,
      DONE,
    ]);
    const types = events.map((e) => e.type);
    expect(types).toEqual([
      "response.created",
      "response.in_progress",
      "response.output_item.added",
      "response.output_item.added",
      "response.function_call_arguments.delta",
      "response.function_call_arguments.delta",
      "response.function_call_arguments.delta",
      "response.function_call_arguments.delta",
      "response.function_call_arguments.done",
      "response.output_item.done",
      "response.function_call_arguments.done",
      "response.output_item.done",
      "response.completed",
    ]);
    const [a, b] = events.filter((e) => e.type === "response.output_item.added").map((e) => e.item as { id: string; call_id: string; name: string; arguments: string; output_index?: number });
    expect(a).toMatchObject({ type: "function_call", call_id: "call_A", name: "get_weather", arguments: "", status: "in_progress" });
    expect(b).toMatchObject({ type: "function_call", call_id: "call_B", name: "get_time", arguments: "", status: "in_progress" });
    const deltas = events.filter((e) => e.type === "response.function_call_arguments.delta").map((e) => [e.item_id, e.output_index, e.delta]);
    expect(deltas).toEqual([
      [b?.id, 1, '{"tz"'],
      [a?.id, 0, '{"city":'],
      [b?.id, 1, ':"UTC"}'],
      [a?.id, 0, '"Oslo"}'],
    ]);
    const dones = events.filter((e) => e.type === "response.function_call_arguments.done").map((e) => [e.item_id, e.name, e.arguments]);
    expect(dones).toEqual([
      [a?.id, "get_weather", '{"city":"Oslo"}'],
      [b?.id, "get_time", '{"tz":"UTC"}'],
    ]);
    expect(finals[0]?.output).toEqual([
      { type: "function_call", id: String(a?.id), call_id: "call_A", name: "get_weather", arguments: '{"city":"Oslo"}', status: "completed" },
      { type: "function_call", id: String(b?.id), call_id: "call_B", name: "get_time", arguments: '{"tz":"UTC"}', status: "completed" },
    ]);
  });

  // decisions.md, Streaming: "Argument text that arrives before a call's name is held until the name comes (the `output_item.added` event must carry it)."
  test("argument text before the call's name is held: the item is added once the name comes, with it, and no argument is lost", async () => {
    const { events, finals } = await translate([
      ROLE,
      chunk({ tool_calls: [{ index: 0, id: "call_A", type: "function", function: { arguments: '{"city":' } }] }),
      chunk({ tool_calls: [{ index: 0, function: { name: "get_weather", arguments: '"Oslo"' } }] }),
      chunk({ tool_calls: [{ index: 0, function: { arguments: "}" } }] }),
      chunk({}, "tool_calls"),
      USAGE,
      DONE,
    ]);
    const added = events.filter((e) => e.type === "response.output_item.added").map((e) => e.item);
    expect(added).toEqual([expect.objectContaining({ type: "function_call", call_id: "call_A", name: "get_weather" })]);
    const deltas = events.filter((e) => e.type === "response.function_call_arguments.delta").map((e) => e.delta);
    expect(deltas).toEqual(['{"city":"Oslo"', "}"]);
    expect(finals[0]?.output).toEqual([expect.objectContaining({ type: "function_call", name: "get_weather", arguments: '{"city":"Oslo"}', status: "completed" })]);
  });

  test("reasoning, then text, then a tool call: each item ends before the next kind begins", async () => {
    const { events, finals } = await translate([
      chunk({ reasoning_content: "Let me " }),
      chunk({ reasoning_content: "think." }),
      chunk({ content: "Checking." }),
      chunk({ tool_calls: [{ index: 0, id: "call_1", type: "function", function: { name: "lookup", arguments: "{}" } }] }),
      chunk({}, "tool_calls"),
      DONE,
    ]);
    expect(events.map((e) => `${e.type}${"output_index" in e ? `@${e.output_index}` : ""}`)).toEqual([
      "response.created",
      "response.in_progress",
      "response.output_item.added@0",
      "response.content_part.added@0",
      "response.reasoning_text.delta@0",
      "response.reasoning_text.delta@0",
      "response.reasoning_text.done@0",
      "response.content_part.done@0",
      "response.output_item.done@0",
      "response.output_item.added@1",
      "response.content_part.added@1",
      "response.output_text.delta@1",
      "response.output_text.done@1",
      "response.content_part.done@1",
      "response.output_item.done@1",
      "response.output_item.added@2",
      "response.function_call_arguments.delta@2",
      "response.function_call_arguments.done@2",
      "response.output_item.done@2",
      "response.completed",
    ]);
    expect(finals[0]?.output.map((i) => i.type)).toEqual(["reasoning", "message", "function_call"]);
    expect(finals[0]?.output[0]).toMatchObject({ content: [{ type: "reasoning_text", text: "Let me think." }], summary: [], status: "completed" });
    expect(finals[0]).not.toHaveProperty("usage");
  });

  test("a refusal streams as a refusal part", async () => {
    const { events, finals } = await translate([chunk({ refusal: "I can't " }), chunk({ refusal: "help." }), chunk({}, "stop"), DONE]);
    expect(events.filter((e) => e.type.startsWith("response.refusal")).map((e) => [e.type, e.delta ?? e.refusal])).toEqual([
      ["response.refusal.delta", "I can't "],
      ["response.refusal.delta", "help."],
      ["response.refusal.done", "I can't help."],
    ]);
    expect(finals[0]?.output[0]).toMatchObject({ type: "message", content: [{ type: "refusal", refusal: "I can't help." }] });
  });

  test("finish_reason length: items done as incomplete, then response.incomplete (max_output_tokens) with usage", async () => {
    const { events, finals } = await translate([chunk({ content: "cut" }), chunk({}, "length"), USAGE, DONE]);
    expect(events.at(-2)).toMatchObject({ type: "response.output_item.done", item: { status: "incomplete" } });
    const last = events.at(-1);
    expect(last?.type).toBe("response.incomplete");
    expect(last?.response).toMatchObject({ status: "incomplete", incomplete_details: { reason: "max_output_tokens" }, usage: { output_tokens: 4 }, completed_at: null });
    expect(finals[0]?.status).toBe("incomplete");
  });

  test("the relay's error event mid-stream: response.failed with the partial output, then an error event, then the end", async () => {
    const { events, finals, state } = await translate([ROLE, chunk({ content: "partial" }), ERROR]);
    expect(events.map((e) => e.type)).toEqual([
      "response.created",
      "response.in_progress",
      "response.output_item.added",
      "response.content_part.added",
      "response.output_text.delta",
      "response.failed",
      "error",
    ]);
    const failed = events[5]?.response as ResponseObject;
    expect(failed).toMatchObject({
      status: "failed",
      error: { code: "server_error", message: "The model 'chat-small' failed while generating: boom" },
      incomplete_details: null,
      completed_at: null,
      output: [{ type: "message", status: "incomplete", content: [{ type: "output_text", text: "partial" }] }],
      output_text: "partial",
    });
    expect(events[6]).toEqual({ type: "error", sequence_number: 6, code: "service_unavailable", message: "The model 'chat-small' failed while generating: boom", param: null });
    expect(finals).toEqual([failed]);
    expect(state.cancelled).toBeUndefined();
  });

  test("a chat stream that ends without [DONE] or an error, or with unreadable JSON, fails the response", async () => {
    const cut = await translate([ROLE, chunk({ content: "a" })]);
    expect(cut.events.slice(-2).map((e) => e.type)).toEqual(["response.failed", "error"]);
    expect(cut.finals[0]?.error?.message).toContain("ended the stream early");
    const junk = await translate([ROLE, "data: {not json\n\n", chunk({ content: "after" }), DONE]);
    expect(junk.events.slice(-2).map((e) => e.type)).toEqual(["response.failed", "error"]);
    expect(junk.finals).toHaveLength(1);
  });

  test("events go out as chunks arrive: a delta is readable while the upstream is still generating", async () => {
    let ctrl: ReadableStreamDefaultController<Uint8Array> | undefined;
    let cancelled: unknown;
    const chat = new ReadableStream<Uint8Array>({
      start(c) {
        ctrl = c;
      },
      cancel(r) {
        cancelled = r;
      },
    });
    const finals: ResponseObject[] = [];
    const reader = responseEventStream(chat, meta(), (r) => {
      finals.push(r);
    }).getReader();
    const dec = new TextDecoder();
    let seen = "";
    const readUntil = async (needle: string) => {
      while (!seen.includes(needle)) {
        const r = await reader.read();
        if (r.done) throw new Error(`ended before ${needle}`);
        seen += dec.decode(r.value);
      }
    };
    await readUntil("response.in_progress");
    ctrl?.enqueue(enc.encode(ROLE + chunk({ content: "first" })));
    await readUntil('"delta":"first"');
    expect(finals).toEqual([]);
    // The client goes away: the chat stream is cancelled (so the upstream call is aborted) and onFinal says so.
    await reader.cancel();
    await until(() => cancelled !== undefined, "the chat stream cancelled");
    expect(finals).toHaveLength(1);
    expect(finals[0]).toMatchObject({ status: "cancelled", output: [{ type: "message", status: "incomplete", content: [{ text: "first" }] }] });
  });

  test("onFinal's promise (storing the response) is awaited before the stream ends", async () => {
    const { stream } = source([ROLE, chunk({ content: "x" }), chunk({}, "stop"), DONE].map((p) => enc.encode(p)));
    let release: (() => void) | undefined;
    let stored = false;
    const storing = async () => {
      await new Promise<void>((res) => {
        release = res;
      });
      stored = true;
    };
    const reader = responseEventStream(stream, meta(), storing).getReader();
    let text = "";
    const dec = new TextDecoder();
    while (!text.includes("response.completed")) {
      const r = await reader.read();
      if (r.done) throw new Error("ended before response.completed");
      text += dec.decode(r.value);
    }
    const end = reader.read();
    await until(() => release !== undefined, "onFinal called");
    // A negative can only be watched for a while: 100 ms, far beyond the close that follows at once when the promise is not awaited.
    expect(await Promise.race([end.then(() => "ended"), Bun.sleep(100).then(() => "open")])).toBe("open");
    release?.();
    expect((await end).done).toBe(true);
    expect(stored).toBe(true);
  });

  test("pinned: response.created and response.in_progress, byte for byte (the Response as it stands, serialised once for both)", () => {
    const tf = responsesTransform(meta({ store: false, instructions: 'be "brief"\n', metadata: { a: "b" }, user: "u", reasoning: { effort: "bogus", summary: "auto" } }), () => {});
    const response = "{\"id\":\"resp_test1\",\"object\":\"response\",\"created_at\":1790000000,\"status\":\"in_progress\",\"background\":false,\"completed_at\":null,\"error\":null,\"incomplete_details\":null,\"instructions\":\"be \\\"brief\\\"\\n\",\"max_output_tokens\":null,\"max_tool_calls\":null,\"model\":\"chat-small\",\"output\":[],\"output_text\":\"\",\"parallel_tool_calls\":true,\"previous_response_id\":null,\"prompt_cache_key\":null,\"prompt_cache_retention\":null,\"reasoning\":{\"effort\":null,\"summary\":\"auto\"},\"safety_identifier\":null,\"service_tier\":\"default\",\"store\":false,\"temperature\":null,\"text\":{\"format\":{\"type\":\"text\"},\"verbosity\":null},\"tool_choice\":\"auto\",\"tools\":[],\"top_logprobs\":null,\"top_p\":null,\"truncation\":\"disabled\",\"metadata\":{\"a\":\"b\"},\"access_programs\":null,\"user\":\"u\"}";
    expect(tf.start()).toBe(
      `event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":${response}}\n\n` +
        `event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1,"response":${response}}\n\n`,
    );
  });

  test("onFinal called once whatever it returns; finish() hands the relay a promise only when onFinal returned one (a response not stored has nothing to wait for)", async () => {
    const events = [ROLE, chunk({ content: "x" }), chunk({}, "stop"), DONE].map((p) => Buffer.from(p));
    const run = (hook: (r: ResponseObject) => void | Promise<void>) => {
      const tf = responsesTransform(meta({ store: false }), hook);
      tf.start();
      for (const e of events) tf.events([e]);
      return tf;
    };
    let calls = 0;
    const plain = run(() => {
      calls++;
    });
    expect(plain.finish()).toBeUndefined();
    expect(plain.finish()).toBeUndefined();
    plain.cancel();
    expect(calls).toBe(1);
    // A hook that throws: the stream still ends cleanly, with nothing to wait for.
    const throwing = run(() => {
      throw new Error("hook");
    });
    expect(throwing.finish()).toBeUndefined();
    // A promise, rejected or not, is waited for (and never rejects the relay's close).
    const failing = run(() => Promise.reject(new Error("store down")));
    const f = failing.finish();
    expect(f).toBeInstanceOf(Promise);
    expect(await f).toBeUndefined();
    expect(failing.finish()).toBe(f);
  });
});


describe("responseEventStream reads chat SSE as the standard does (test/helpers/sse-spec.ts)", () => {
  /** The text the Responses stream gives for a chat stream read in `parts` (no [DONE]: it then fails, with the text so far). */
  const textOf = async (parts: Uint8Array[]) => {
    const { stream } = source(parts);
    const out = await new Response(responseEventStream(stream, meta(), () => {})).text();
    // Keep-alives (an upstream's comment-only events) are no events.
    return parseEvents(out.replaceAll(": keep-alive\n\n", ""))
      .filter((e) => e.type === "response.output_text.delta")
      .map((e) => e.delta)
      .join("");
  };
  for (const row of SPEC_ROWS) {
    test(row.name, async () => {
      const bytes = enc.encode(row.input);
      // An event with empty data is no chunk: passed over (as the chat relay passes it over).
      const want = row.data
        .filter((d) => d !== "")
        .map((d) => chunkText(d) ?? "")
        .join("");
      expect(await textOf([bytes]), "whole").toBe(want);
      for (let at = 1; at < bytes.length; at++) expect(await textOf(cut(bytes, [at])), `cut at ${at}`).toBe(want);
      expect(await textOf(cut(bytes, Array.from(bytes.keys()))), "a byte a read").toBe(want);
    });
  }
});

describe("plainTextDelta (chunks read without a full parse)", () => {
  const chunk = (over: Record<string, unknown> = {}, choice: Record<string, unknown> = {}) =>
    JSON.stringify({
      id: "chatcmpl-1",
      object: "chat.completion.chunk",
      created: 1,
      model: "m",
      ...over,
      choices: [{ index: 0, delta: { content: "hi" }, logprobs: null, finish_reason: null, ...choice }],
    });

  /** What the full parse makes of a chunk, when it is a plain text delta of choice 0 and nothing else. */
  const plain = (payload: string): string | undefined => {
    let v: unknown;
    try {
      v = JSON.parse(payload);
    } catch {
      return undefined;
    }
    if (typeof v !== "object" || v === null || "usage" in v || "error" in v) return undefined;
    const choices = (v as { choices?: unknown }).choices;
    if (!Array.isArray(choices) || choices.length !== 1) return undefined;
    const c = choices[0] as Record<string, unknown>;
    const keys = Object.keys(c).join(",");
    const d = c.delta as Record<string, unknown> | undefined;
    if (keys !== "index,delta,logprobs,finish_reason" || c.index !== 0 || c.logprobs !== null || c.finish_reason !== null) return undefined;
    if (!d || Object.keys(d).join(",") !== "content" || typeof d.content !== "string") return undefined;
    return d.content;
  };

  test("takes exactly the plain text deltas, with the text the full parse gives", () => {
    const texts = ["", "hi", ' "quoted" ', "back\\slash\\", "\\u0041 literal", "line\nbreak\ttab", "é😀\u2028", '"},"logprobs":null,"finish_reason":null}]}', "</script>"];
    const payloads: string[] = [];
    for (const t of texts) {
      payloads.push(chunk({}, { delta: { content: t } }));
      payloads.push(chunk({ usage: { prompt_tokens: 1 } }, { delta: { content: t } }));
      payloads.push(chunk({ object: "error" }, { delta: { content: t } }));
      payloads.push(chunk({}, { delta: { content: t }, finish_reason: "stop" }));
      payloads.push(chunk({}, { delta: { content: t }, logprobs: { content: [] } }));
      payloads.push(chunk({}, { delta: { role: "assistant", content: t } }));
      payloads.push(chunk({}, { index: 1, delta: { content: t } }));
      payloads.push(JSON.stringify({ id: "x", choices: [{ index: 0, delta: { content: t }, logprobs: null, finish_reason: null }, { index: 1, delta: { content: t }, logprobs: null, finish_reason: null }] }));
      payloads.push(`${chunk({}, { delta: { content: t } })}}`);
      payloads.push(JSON.stringify({ wrap: JSON.parse(chunk({}, { delta: { content: t } })) }));
      payloads.push(` ${chunk({}, { delta: { content: t } })}`);
    }
    // Random texts, including quotes, backslashes and the tail's own characters.
    const alphabet = 'ab"\\}]{[,:nul é😀\n';
    for (let i = 0; i < 2_000; i++) {
      let t = "";
      const n = Math.floor(Math.random() * 12);
      for (let j = 0; j < n; j++) t += [...alphabet][Math.floor(Math.random() * [...alphabet].length)];
      payloads.push(chunk({}, { delta: { content: t } }));
      // Raw (unescaped) text spliced in: not JSON, or not one string.
      payloads.push(`{"id":"x","choices":[{"index":0,"delta":{"content":"${t}"},"logprobs":null,"finish_reason":null}]}`);
    }
    let taken = 0;
    for (const p of payloads) {
      const got = plainTextDelta(p);
      if (got !== undefined) {
        taken++;
        expect({ p, got }).toEqual({ p, got: plain(p) as string });
      }
    }
    // The fast path is taken for every plain delta written as vLLM writes them.
    for (const t of texts) expect(plainTextDelta(chunk({}, { delta: { content: t } }))).toBe(t);
    expect(taken).toBeGreaterThan(2_000);
  });
});
