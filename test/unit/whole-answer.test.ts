import { describe, expect, test } from "bun:test";
import fc from "fast-check";
import { countTextAfterReport, type ReportedText, sseAsCompletion, wholeAnswer } from "../../src/inference/whole-answer.ts";
import { chunkText, SPEC_ROWS } from "../helpers/sse-spec.ts";

/** A chat completion's choices as an upstream might send them: text, reasoning, refusal, tool calls. */
const choiceArb = fc.record({
  content: fc.option(fc.string({ unit: "binary" }), { nil: undefined }),
  reasoning_content: fc.option(fc.string(), { nil: undefined }),
  refusal: fc.option(fc.string(), { nil: undefined }),
  tool_calls: fc.option(
    fc.array(fc.record({ id: fc.string(), type: fc.constant("function"), function: fc.record({ name: fc.string(), arguments: fc.string() }) }), { minLength: 1, maxLength: 3 }),
    { nil: undefined },
  ),
  finish_reason: fc.constantFrom("stop", "length", "tool_calls"),
});

describe("whole answers", () => {
  test("a completion turned into stream events and put together again is the same answer", () => {
    fc.assert(
      fc.property(fc.array(choiceArb, { minLength: 1, maxLength: 3 }), fc.option(fc.record({ prompt_tokens: fc.nat(), completion_tokens: fc.nat() }), { nil: undefined }), (choices, usage) => {
        const completion = {
          id: "c1",
          object: "chat.completion",
          created: 1,
          model: "up",
          choices: choices.map(({ finish_reason, ...m }, index) => ({ index, message: { role: "assistant", ...m }, finish_reason })),
          ...(usage ? { usage } : {}),
        };
        const events = wholeAnswer(Buffer.from(JSON.stringify(completion)), "svc-fast");
        if (!events || !("events" in events)) throw new Error("not converted");
        const back = sseAsCompletion(events.events.toString("utf8"));
        if (!back || "error" in back) throw new Error("not put together");
        expect(back.usage).toEqual(usage);
        const got = back.choices as { index: number; message: Record<string, unknown>; finish_reason: string }[];
        expect(got.map((c) => c.finish_reason)).toEqual(choices.map((c) => c.finish_reason));
        got.forEach((c, i) => {
          const want = choices[i];
          // An empty string sent as text is no text: the stream carries nothing for it.
          expect(c.message.content ?? "").toBe(want?.content ?? "");
          expect(c.message.reasoning_content ?? "").toBe(want?.reasoning_content ?? "");
          expect(c.message.refusal ?? "").toBe(want?.refusal ?? "");
          expect(c.message.tool_calls).toEqual(want?.tool_calls);
        });
      }),
      { numRuns: 300 },
    );
  });

  test("any text: never throws, and what is not SSE or JSON is not an answer", () => {
    fc.assert(
      fc.property(fc.string({ unit: "binary", maxLength: 400 }), (text) => {
        const buf = Buffer.from(text);
        wholeAnswer(buf, "a");
        sseAsCompletion(text);
        sseAsCompletion(`data: ${text}\n\n`);
      }),
      { numRuns: 2_000 },
    );
    expect(wholeAnswer(Buffer.from("<html>bad gateway</html>"), "a")).toBeUndefined();
    expect(sseAsCompletion("<html>bad gateway</html>")).toBeUndefined();
    expect(sseAsCompletion('data: {"error":{"message":"x"}}\n\n')).toEqual({ error: '{"error":{"message":"x"}}' });
    // A tool-call index out of range is folded into call 0, not an array of a billion holes.
    const far = sseAsCompletion('data: {"choices":[{"index":1000000000,"delta":{"tool_calls":[{"index":1000000000,"function":{"arguments":"a"}}]}}]}\n\n');
    expect(JSON.stringify(far)).toContain('"arguments":"a"');
    // Arguments an upstream streams parsed become their JSON text.
    const parsed = sseAsCompletion('data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"f","arguments":{"q":1}}}]}}]}\n\n');
    expect(JSON.stringify(parsed)).toContain('"arguments":"{\\"q\\":1}"');
  });

  test("[DONE] ends the answer: whatever follows it (text, usage, an error, what is not SSE) changes nothing", () => {
    const answer = 'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"abcd"}}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}\n\ndata: [DONE]\n\n';
    const whole = sseAsCompletion(answer);
    expect(JSON.stringify(whole)).toContain('"content":"abcd"');
    fc.assert(
      fc.property(fc.string({ unit: "binary", maxLength: 200 }), (after) => {
        for (const rest of [after, `data: ${after}\n\n`]) expect(sseAsCompletion(answer + rest)).toEqual(whole);
      }),
      { numRuns: 500 },
    );
    // Before: text after [DONE] was appended (and charged past the report), an error after it failed the answer.
    expect(sseAsCompletion(`${answer}data: {"choices":[{"index":0,"delta":{"content":"xxxx"}}]}\n\n`)).toEqual(whole);
    expect(sseAsCompletion(`${answer}data: {"error":{"message":"x"}}\n\n`)).toEqual(whole);
  });
});

describe("text after the last usage report", () => {
  const answer = (report: Record<string, unknown>, first = "abcd") =>
    `data: {"id":"c1","choices":[{"index":0,"delta":{"content":"${first}"}}],"usage":${JSON.stringify(report)}}\n\n` +
    `data: {"id":"c1","choices":[{"index":0,"delta":{"content":"${"x".repeat(400)}"}}]}\n\ndata: [DONE]\n\n`;
  const unbounded = { promptTokens: Number.POSITIVE_INFINITY, completionTokens: Number.POSITIVE_INFINITY };

  test("the answer's usage is the report as the upstream sent it; the text before and after it is told apart", () => {
    const reported: ReportedText = { before: 0, after: 0, events: 0, eventsAfter: 0 };
    const got = sseAsCompletion(answer({ prompt_tokens: 9, completion_tokens: 1, total_tokens: 10 }), reported);
    // Before: completion_tokens 101 and total_tokens 110, the gateway's sum in the upstream's place.
    expect(got && "usage" in got ? got.usage : undefined).toEqual({ prompt_tokens: 9, completion_tokens: 1, total_tokens: 10 });
    expect(reported).toEqual({ before: 4, after: 400, events: 2, eventsAfter: 1 });
    // No report: nothing is told apart (the estimate of the whole answer is what counts).
    const none: ReportedText = { before: 0, after: 0, events: 0, eventsAfter: 0 };
    sseAsCompletion('data: {"choices":[{"index":0,"delta":{"content":"abcd"}}]}\n\n', none);
    expect(none).toEqual({ before: 0, after: 0, events: 1, eventsAfter: 0 });
  });

  test("countTextAfterReport: the report checked as sent, then the text after it added (~4 bytes a token), never past the bound", () => {
    const reported = { before: 4, after: 400, events: 2, eventsAfter: 1 };
    expect(countTextAfterReport({ prompt_tokens: 9, completion_tokens: 1 }, 8, reported, unbounded)).toEqual({ promptTokens: 9, completionTokens: 101, rejected: undefined });
    // Past the bound: capped there, and nothing the upstream sent was implausible.
    expect(countTextAfterReport({ prompt_tokens: 9, completion_tokens: 1 }, 8, reported, { ...unbounded, completionTokens: 10 })).toEqual({ promptTokens: 9, completionTokens: 10, rejected: undefined });
    // The upstream's own count past the bound: named as it sent it.
    expect(countTextAfterReport({ prompt_tokens: 9, completion_tokens: 50 }, 8, reported, { ...unbounded, completionTokens: 10 })).toEqual({ promptTokens: 9, completionTokens: 10, rejected: { completion_tokens: "50" } });
    // 0 reported before any text is a count (nothing was generated yet), not a placeholder.
    expect(countTextAfterReport({ prompt_tokens: 9, completion_tokens: 0 }, 8, { before: 0, after: 400, events: 1, eventsAfter: 1 }, unbounded)).toEqual({ promptTokens: 9, completionTokens: 100, rejected: undefined });
    // Text of a byte a token (digits, one an event): each event after the report is at least a token, not a quarter of one.
    expect(countTextAfterReport({ prompt_tokens: 9, completion_tokens: 1 }, 8, { before: 1, after: 200, events: 201, eventsAfter: 200 }, unbounded)).toEqual({ promptTokens: 9, completionTokens: 1 + 200, rejected: undefined });
    // 0 after text is a placeholder: named, replaced by the estimate of the text before it, and the text after added.
    expect(countTextAfterReport({ prompt_tokens: 9, completion_tokens: 0 }, 8, reported, unbounded)).toEqual({ promptTokens: 9, completionTokens: 1 + 100, rejected: { completion_tokens: "0" } });
  });
});

describe("sseAsCompletion reads SSE as the standard does (test/helpers/sse-spec.ts)", () => {
  for (const row of SPEC_ROWS) {
    test(row.name, () => {
      // Events with empty data carry no chunk and are passed over; the chunks' text is put together in order.
      const texts = row.data.filter((d) => d !== "").map(chunkText);
      const want = texts.length === 0 || texts.some((t) => t === undefined) ? undefined : texts.join("");
      const got = sseAsCompletion(row.input);
      const text = got && !("error" in got) ? (got.choices as { message: { content: unknown } }[])[0]?.message.content : undefined;
      expect(text).toBe(want);
    });
  }
});
