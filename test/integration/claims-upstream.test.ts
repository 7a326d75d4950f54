import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import type { Gateway } from "../../src/server.ts";
import type { SeededOrg } from "../helpers/harness.ts";
import { type HostileConn, gatewayWithStandby, helloAnswer } from "../helpers/hostile-upstream.ts";
import { post, rec, userMessages } from "./inference-fixtures.ts";

setDefaultTimeout(60_000);

/**
 * Claims of docs/decisions.md about upstream answers that no test could
 * fail on: the error-body shapes the gateway reads (FastAPI's `detail`), an
 * error body cut off in its JSON (not shown as a message), and the bound on
 * interim 1xx answers. An upstream written byte for byte on a raw socket,
 * through the whole gateway.
 */

let gw: Gateway;
let org: SeededOrg;
let stop = async () => {};
/** What the upstream answers; each test sets it. */
let respond: (c: HostileConn) => void = () => {};

const json = helloAnswer();

beforeAll(async () => {
  ({ gw, org, stop } = await gatewayWithStandby((c) => respond(c)));
});
afterAll(() => stop());

const chat = (model = "svc-fast") => post(gw, "/v1/chat/completions", org.personalKey, { model, messages: userMessages() }, { signal: AbortSignal.timeout(30_000) });

/** An error answer of `status` with a JSON body. */
const errorAnswer = (status: number, body: unknown) => {
  const text = JSON.stringify(body);
  return `HTTP/1.1 ${status} Error\r\ncontent-type: application/json\r\ncontent-length: ${Buffer.byteLength(text)}\r\n\r\n${text}`;
};

/** The whole error answer: status, and the body, which must be exactly our wire shape. */
async function errorOf(res: Response): Promise<{ status: number; error: Record<string, unknown> }> {
  const body = rec(await res.json());
  expect(Object.keys(body)).toEqual(["error"]);
  return { status: res.status, error: rec(body.error) };
}

describe("upstream error bodies (docs/decisions.md: Upstream 4xx, Upstream body timers)", () => {
  test("FastAPI's `detail`, a string or a list of validation errors, is the message of our 400; its shape never reaches the client", async () => {
    respond = (c) => c.write(errorAnswer(400, { detail: "Stop sequences must not be empty" }));
    expect(await errorOf(await chat())).toEqual({
      status: 400,
      error: { message: "Stop sequences must not be empty", type: "invalid_request_error", param: null, code: "invalid_request_error" },
    });
    // What vLLM's FastAPI app sends for a body its request model refuses.
    const validation = { detail: [{ type: "missing", loc: ["body", "messages"], msg: "Field required", input: {} }, { type: "int_parsing", loc: ["body", "n"], msg: "Input should be a valid integer", input: "x" }] };
    respond = (c) => c.write(errorAnswer(422, validation));
    const { status, error } = await errorOf(await chat());
    expect(status).toBe(400);
    expect(error.message).toBe("Field required; Input should be a valid integer");
    expect(error.code).toBe("invalid_request_error");
  });

  test("an error body cut off inside its JSON is not shown as a message (plain text cut off is, see upstream-hostile)", async () => {
    const front = '{"error":{"message":"This model\'s maximum context length is 32768 tokens", "type":"BadRequestError"';
    // Content-Length promises more than is sent, then the connection closes.
    respond = (c) => {
      c.write(`HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: ${front.length + 100}\r\n\r\n${front}`);
      setTimeout(() => c.socket.end(), 50);
    };
    const { status, error } = await errorOf(await chat());
    expect(status).toBe(400);
    expect(error.code).toBe("invalid_request_error");
    expect(error.message).toBe("The upstream model server rejected the request.");
  });
});

describe("interim 1xx answers (docs/decisions.md: HTTP/1.1 framing)", () => {
  const interim = (n: number) => "HTTP/1.1 100 Continue\r\n\r\n".repeat(n);

  test("at most 8 are skipped: 8 before the answer are read; a 9th is a server that never answers, a failed attempt (the standby answers)", async () => {
    respond = (c) => c.write(`${interim(8)}${json}`);
    const ok = await chat();
    expect(ok.status).toBe(200);
    expect(rec(rec((rec(await ok.json()).choices as unknown[])[0]).message).content).toBe("hello");

    respond = (c) => c.write(`${interim(9)}${json}`);
    const refused = await chat();
    expect(refused.status).toBe(503);
    expect((await errorOf(refused)).error.code).toBe("service_unavailable");
    const failedOver = await chat("svc-fo");
    expect(failedOver.status).toBe(200);
    expect(rec(await failedOver.json()).model).toBe("svc-fo");
  });
});
