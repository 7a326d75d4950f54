/**
 * The SSE standard's interpretation of an event stream
 * (https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation),
 * as a table every reader of upstream SSE in the gateway is held to:
 * inference/stream.ts's relay, whole-answer.ts's `sseAsCompletion`, the
 * Responses translation's reader and src/lib/sse.ts itself.
 *
 * Each row is a stream and the data of the events the standard dispatches
 * from it, in order. The data are chat chunks (`C("a")`: a delta with the
 * text "a"), so a reader that only shows what it made of the chunks (the text
 * put together) can be checked on the same rows.
 */

/** A chat chunk whose one delta has the text `t`. */
export const C = (t: string) => `{"choices":[{"index":0,"delta":{"content":${JSON.stringify(t)}}}]}`;

export interface SpecRow {
  name: string;
  /** The stream, as text (encoded as UTF-8: a U+FEFF at its start is the byte order mark). */
  input: string;
  /** The data of each event dispatched, in order. */
  data: string[];
}

/** `C(t)` split after its `"index":0,`: two `data:` lines' worth, joined by the reader with a line feed. */
const [HEAD, TAIL] = ((s: string) => [s.slice(0, s.indexOf(",") + 1), s.slice(s.indexOf(",") + 1)])(C("m"));

export const SPEC_ROWS: SpecRow[] = [
  { name: "LF line ends", input: `data: ${C("a")}\n\ndata: ${C("b")}\n\n`, data: [C("a"), C("b")] },
  { name: "CRLF line ends", input: `data: ${C("a")}\r\n\r\ndata: ${C("b")}\r\n\r\n`, data: [C("a"), C("b")] },
  { name: "CR line ends", input: `data: ${C("a")}\r\rdata: ${C("b")}\r\r`, data: [C("a"), C("b")] },
  { name: "line ends that change from event to event", input: `data: ${C("a")}\n\ndata: ${C("b")}\r\n\r\ndata: ${C("c")}\r\rdata: ${C("d")}\n\n`, data: [C("a"), C("b"), C("c"), C("d")] },
  { name: "CRLF events, then LF ones", input: `data: ${C("a")}\r\n\r\ndata: ${C("b")}\n\ndata: ${C("c")}\n\n`, data: [C("a"), C("b"), C("c")] },
  { name: "a blank line ended by another kind of line end than its event's last line", input: `data: ${C("a")}\n\r\ndata: ${C("b")}\r\n\ndata: ${C("c")}\r\n\rdata: ${C("d")}\n\r`, data: [C("a"), C("b"), C("c"), C("d")] },
  { name: "a byte order mark at the start of the stream is not part of the first line", input: `\uFEFFdata: ${C("a")}\n\ndata: ${C("b")}\n\n`, data: [C("a"), C("b")] },
  { name: "a byte order mark anywhere else is (the field is `\\uFEFFdata`, which no reader knows)", input: `data: ${C("a")}\n\n\uFEFFdata: ${C("b")}\n\ndata: ${C("c")}\n\n`, data: [C("a"), C("c")] },
  { name: "`data:` without a space", input: `data:${C("a")}\n\n`, data: [C("a")] },
  { name: "only one leading space is removed", input: `data:  ${C("a")}\n\n`, data: [` ${C("a")}`] },
  { name: "a tab is not a space", input: `data:\t${C("a")}\n\n`, data: [`\t${C("a")}`] },
  { name: "a colon in the value", input: `data: ${C("a:b")}\n\n`, data: [C("a:b")] },
  { name: "empty data, with and without its space", input: `data:\n\ndata: \n\ndata: ${C("a")}\n\n`, data: ["", "", C("a")] },
  { name: "a `data` line without a colon is a data field with an empty value", input: `data\n\ndata: ${C("a")}\n\n`, data: ["", C("a")] },
  { name: "a `data` line without a colon adds a line to the data", input: `data: ${HEAD}\ndata\ndata: ${TAIL}\n\n`, data: [`${HEAD}\n\n${TAIL}`] },
  { name: "data over several lines is joined with line feeds", input: `data: ${HEAD}\ndata: ${TAIL}\n\n`, data: [`${HEAD}\n${TAIL}`] },
  { name: "data over several lines with CR line ends", input: `data: ${HEAD}\rdata: ${TAIL}\r\r`, data: [`${HEAD}\n${TAIL}`] },
  { name: "other fields, with and without a colon, are not data", input: `event: message\nid: 7\nretry: 100\nevent\nfoo: bar\ndata: ${C("a")}\nid\n\n`, data: [C("a")] },
  { name: "field names are case-sensitive and end at the colon", input: `Data: ${C("x")}\ndata : ${C("y")}\n\ndata: ${C("a")}\n\n`, data: [C("a")] },
  { name: "an event without data dispatches nothing", input: `event: ping\nid: 1\n\nretry: 5\n\ndata: ${C("a")}\n\n`, data: [C("a")] },
  { name: "comment lines are ignored, within an event or as one", input: `: hello\n\n:\ndata: ${C("a")}\n: between\n\n: ${C("x")}\n\n`, data: [C("a")] },
  { name: "blank lines before and between events dispatch nothing", input: `\n\r\n\rdata: ${C("a")}\n\n\n\n\r\ndata: ${C("b")}\n\n`, data: [C("a"), C("b")] },
  { name: "an event the stream ends before its blank line is not dispatched", input: `data: ${C("a")}\n\ndata: ${C("b")}\n`, data: [C("a")] },
  { name: "… nor one whose last line has no end", input: `data: ${C("a")}\n\ndata: ${C("b")}`, data: [C("a")] },
  { name: "non-ASCII text", input: `data: ${C("héllo 😀 漢字")}\n\n`, data: [C("héllo 😀 漢字")] },
];

/**
 * The events' data in a stream the gateway wrote (a chat relay's output):
 * the standard's reading again, written here as plainly as it reads, as the
 * oracle for a reader whose output is itself SSE.
 */
export function specData(text: string): string[] {
  const out: string[] = [];
  let data: string[] | undefined;
  const s = text.startsWith("\uFEFF") ? text.slice(1) : text;
  const lines = s.split(/\r\n|\r|\n/);
  // The last piece has no line end: it is not a line (and any event it belongs to is not dispatched).
  lines.pop();
  for (const line of lines) {
    if (line === "") {
      if (data !== undefined) out.push(data.join("\n"));
      data = undefined;
      continue;
    }
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") {
      data ??= [];
      data.push(value);
    }
  }
  return out;
}

/** The text of each chunk in `data` (what a reader that puts the chunks together shows), or undefined for data that is not a chunk. */
export function chunkText(data: string): string | undefined {
  try {
    const v = JSON.parse(data) as { choices?: { delta?: { content?: unknown } }[] };
    const t = v.choices?.[0]?.delta?.content;
    return typeof t === "string" ? t : undefined;
  } catch {
    return undefined;
  }
}

/** `bytes` cut into pieces at the given offsets. */
export function cut(bytes: Uint8Array, at: number[]): Uint8Array[] {
  const points = [0, ...at.filter((n) => n > 0 && n < bytes.length).sort((a, b) => a - b), bytes.length];
  const parts: Uint8Array[] = [];
  for (let i = 1; i < points.length; i++) if ((points[i] ?? 0) > (points[i - 1] ?? 0)) parts.push(bytes.subarray(points[i - 1], points[i]));
  return parts;
}
