/**
 * The exact bytes of a short Responses stream (text, then a function call
 * whose arguments come in pieces), one upstream chunk a read and all in one
 * read: pinned, so that a change to how the events are put together (bytes or
 * strings, which path a chunk takes) cannot change what goes on the wire.
 * Only the random item ids and the completion time are normalised.
 */
import { describe, expect, test } from "bun:test";
import { responsesTransform } from "../../src/responses/events.ts";
import { chunk, DONE, meta, ROLE, USAGE } from "../helpers/responses.ts";

const CHUNKS = [
  ROLE,
  chunk({ content: "Hi \"there\"\n" }),
  chunk({ content: "é😀" }),
  chunk({ tool_calls: [{ index: 0, id: "call_abc", type: "function", function: { name: "get_weather", arguments: "" } }] }),
  chunk({ tool_calls: [{ index: 0, function: { arguments: '{"city":' } }] }),
  chunk({ tool_calls: [{ index: 0, function: { arguments: '"Paris \\"FR\\""' } }] }),
  chunk({ tool_calls: [{ index: 0, function: { arguments: "}" } }] }),
  chunk({}, "tool_calls"),
  USAGE,
  DONE,
];

const PINNED = [
  "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_test1\",\"object\":\"response\",\"created_at\":1790000000,\"status\":\"in_progress\",\"background\":false,\"completed_at\":null,\"error\":null,\"incomplete_details\":null,\"instructions\":null,\"max_output_tokens\":null,\"max_tool_calls\":null,\"model\":\"chat-small\",\"output\":[],\"output_text\":\"\",\"parallel_tool_calls\":true,\"previous_response_id\":null,\"prompt_cache_key\":null,\"prompt_cache_retention\":null,\"reasoning\":{\"effort\":null,\"summary\":null},\"safety_identifier\":null,\"service_tier\":\"default\",\"store\":false,\"temperature\":null,\"text\":{\"format\":{\"type\":\"text\"},\"verbosity\":null},\"tool_choice\":\"auto\",\"tools\":[],\"top_logprobs\":null,\"top_p\":null,\"truncation\":\"disabled\",\"metadata\":{},\"access_programs\":null}}\n\n",
  "event: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"sequence_number\":1,\"response\":{\"id\":\"resp_test1\",\"object\":\"response\",\"created_at\":1790000000,\"status\":\"in_progress\",\"background\":false,\"completed_at\":null,\"error\":null,\"incomplete_details\":null,\"instructions\":null,\"max_output_tokens\":null,\"max_tool_calls\":null,\"model\":\"chat-small\",\"output\":[],\"output_text\":\"\",\"parallel_tool_calls\":true,\"previous_response_id\":null,\"prompt_cache_key\":null,\"prompt_cache_retention\":null,\"reasoning\":{\"effort\":null,\"summary\":null},\"safety_identifier\":null,\"service_tier\":\"default\",\"store\":false,\"temperature\":null,\"text\":{\"format\":{\"type\":\"text\"},\"verbosity\":null},\"tool_choice\":\"auto\",\"tools\":[],\"top_logprobs\":null,\"top_p\":null,\"truncation\":\"disabled\",\"metadata\":{},\"access_programs\":null}}\n\n",
  "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"sequence_number\":2,\"output_index\":0,\"item\":{\"type\":\"message\",\"id\":\"msg_x\",\"status\":\"in_progress\",\"role\":\"assistant\",\"content\":[]}}\n\n",
  "event: response.content_part.added\ndata: {\"type\":\"response.content_part.added\",\"sequence_number\":3,\"item_id\":\"msg_x\",\"output_index\":0,\"content_index\":0,\"part\":{\"type\":\"output_text\",\"text\":\"\",\"annotations\":[],\"logprobs\":[]}}\n\n",
  "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":4,\"item_id\":\"msg_x\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi \\\"there\\\"\\n\",\"logprobs\":[]}\n\n",
  "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":5,\"item_id\":\"msg_x\",\"output_index\":0,\"content_index\":0,\"delta\":\"é😀\",\"logprobs\":[]}\n\n",
  "event: response.output_text.done\ndata: {\"type\":\"response.output_text.done\",\"sequence_number\":6,\"item_id\":\"msg_x\",\"output_index\":0,\"content_index\":0,\"text\":\"Hi \\\"there\\\"\\né😀\",\"logprobs\":[]}\n\n",
  "event: response.content_part.done\ndata: {\"type\":\"response.content_part.done\",\"sequence_number\":7,\"item_id\":\"msg_x\",\"output_index\":0,\"content_index\":0,\"part\":{\"type\":\"output_text\",\"text\":\"Hi \\\"there\\\"\\né😀\",\"annotations\":[],\"logprobs\":[]}}\n\n",
  "event: response.output_item.done\ndata: {\"type\":\"response.output_item.done\",\"sequence_number\":8,\"output_index\":0,\"item\":{\"type\":\"message\",\"id\":\"msg_x\",\"status\":\"completed\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi \\\"there\\\"\\né😀\",\"annotations\":[],\"logprobs\":[]}]}}\n\n",
  "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"sequence_number\":9,\"output_index\":1,\"item\":{\"type\":\"function_call\",\"id\":\"fc_x\",\"call_id\":\"call_abc\",\"name\":\"get_weather\",\"arguments\":\"\",\"status\":\"in_progress\"}}\n\n",
  "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"sequence_number\":10,\"item_id\":\"fc_x\",\"output_index\":1,\"delta\":\"{\\\"city\\\":\"}\n\n",
  "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"sequence_number\":11,\"item_id\":\"fc_x\",\"output_index\":1,\"delta\":\"\\\"Paris \\\\\\\"FR\\\\\\\"\\\"\"}\n\n",
  "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"sequence_number\":12,\"item_id\":\"fc_x\",\"output_index\":1,\"delta\":\"}\"}\n\n",
  "event: response.function_call_arguments.done\ndata: {\"type\":\"response.function_call_arguments.done\",\"sequence_number\":13,\"item_id\":\"fc_x\",\"output_index\":1,\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris \\\\\\\"FR\\\\\\\"\\\"}\"}\n\n",
  "event: response.output_item.done\ndata: {\"type\":\"response.output_item.done\",\"sequence_number\":14,\"output_index\":1,\"item\":{\"type\":\"function_call\",\"id\":\"fc_x\",\"call_id\":\"call_abc\",\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris \\\\\\\"FR\\\\\\\"\\\"}\",\"status\":\"completed\"}}\n\n",
  "event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":15,\"response\":{\"id\":\"resp_test1\",\"object\":\"response\",\"created_at\":1790000000,\"status\":\"completed\",\"background\":false,\"completed_at\":0,\"error\":null,\"incomplete_details\":null,\"instructions\":null,\"max_output_tokens\":null,\"max_tool_calls\":null,\"model\":\"chat-small\",\"output\":[{\"type\":\"message\",\"id\":\"msg_x\",\"status\":\"completed\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi \\\"there\\\"\\né😀\",\"annotations\":[],\"logprobs\":[]}]},{\"type\":\"function_call\",\"id\":\"fc_x\",\"call_id\":\"call_abc\",\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris \\\\\\\"FR\\\\\\\"\\\"}\",\"status\":\"completed\"}],\"output_text\":\"Hi \\\"there\\\"\\né😀\",\"parallel_tool_calls\":true,\"previous_response_id\":null,\"prompt_cache_key\":null,\"prompt_cache_retention\":null,\"reasoning\":{\"effort\":null,\"summary\":null},\"safety_identifier\":null,\"service_tier\":\"default\",\"store\":false,\"temperature\":null,\"text\":{\"format\":{\"type\":\"text\"},\"verbosity\":null},\"tool_choice\":\"auto\",\"tools\":[],\"top_logprobs\":null,\"top_p\":null,\"truncation\":\"disabled\",\"metadata\":{},\"access_programs\":null,\"usage\":{\"input_tokens\":12,\"input_tokens_details\":{\"cached_tokens\":8,\"cache_write_tokens\":0},\"output_tokens\":4,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":16}}}\n\n",
].join("");

function run(reads: string[]): string {
  const tf = responsesTransform(meta({ store: false }), () => {});
  const dec = new TextDecoder();
  let out = tf.start();
  for (const r of reads) {
    const e = tf.events([Buffer.from(r)]);
    out += typeof e === "string" ? e : dec.decode(e);
  }
  const f = tf.finish();
  expect(f).toBeUndefined();
  return out.replace(/"(msg|fc)_[0-9a-f]+"/g, '"$1_x"').replace(/"completed_at":\d+/g, '"completed_at":0');
}

describe("the Responses stream's bytes", () => {
  test("text and a function call, a chunk a read: pinned", () => {
    expect(run(CHUNKS)).toBe(PINNED);
  });
  test("the same chunks in one read: the same bytes", () => {
    expect(run([CHUNKS.join("")])).toBe(run(CHUNKS));
  });
});
