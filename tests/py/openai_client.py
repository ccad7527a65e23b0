"""Drives a tokenlog gateway with the unmodified `openai` package (run by openai_compat.rs).

argv: base_url model
Checks: models list; a streamed chat completion equals the non-streamed one (greedy); a background
streamed response, dropped after a few events and resumed with
responses.retrieve(id, stream=True, starting_after=N), has every sequence number exactly once and
its deltas add up to the final text; the retrieved response matches.
"""
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)

ids = [m.id for m in client.models.list().data]
assert model in ids, ids

messages = [{"role": "user", "content": "Name three colours."}]
stream = client.chat.completions.create(model=model, messages=messages, stream=True, max_tokens=16, temperature=0)
chunks = list(stream)
streamed = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
assert chunks[-1].choices[0].finish_reason in ("stop", "length"), chunks[-1]
whole = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
assert whole.choices[0].message.content == streamed, (whole.choices[0].message.content, streamed)
assert whole.usage.completion_tokens >= 1
print(f"chat: {len(chunks)} chunks, text {streamed!r}")

s = client.responses.create(
    model=model, input="Count from one to ten.", background=True, stream=True, max_output_tokens=40, temperature=0
)
seen = []
response_id = None
for ev in s:
    seen.append(ev)
    if ev.type == "response.created":
        response_id = ev.response.id
    if len(seen) >= 9:
        break
s.close()  # drop the connection mid-stream
assert response_id, seen
last = seen[-1].sequence_number
rest = list(client.responses.retrieve(response_id, stream=True, starting_after=last))
events = seen + rest
numbers = [e.sequence_number for e in events]
assert numbers == list(range(len(numbers))), numbers
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
done = [e for e in events if e.type == "response.output_text.done"]
assert len(done) == 1 and done[0].text == deltas, (done, deltas)
final = events[-1]
assert final.type in ("response.completed", "response.incomplete"), final.type
assert final.response.output_text == deltas
again = client.responses.retrieve(response_id)
assert again.status == final.response.status, again.status
assert again.output_text == deltas
print(f"responses: dropped after seq {last}, resumed {len(rest)} events, {len(events)} in all, text {deltas!r}")
print("OPENAI-CLIENT-OK")
