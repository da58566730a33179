"""The official `openai` package against wavefront's OpenAI-compatible HTTP front, and Python's
grpcio-reflection (reflection v1alpha) against its gRPC port.

Usage: python openai_check.py HTTP_ADDR GRPC_ADDR METRICS_ADDR
A `wavefront serve --model tests/fixtures/llada` (chat template, masked diffusion) runs there.
Exits non-zero on any mismatch.
"""
import json
import sys
import time
import urllib.request

import grpc
import openai
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

http_addr, grpc_addr, metrics_addr = sys.argv[1:4]
client = openai.OpenAI(base_url=f"http://{http_addr}/v1", api_key="unused", max_retries=0)
passed = 0

models = [m.id for m in client.models.list()]
assert models == ["llada"], models

# Completions, unary, with a scheme through extra_body.
scheme = {"low_confidence": {"block_length": 8, "steps": 8}}
c = client.completions.create(model="llada", prompt="You may copy", max_tokens=16, temperature=0,
                              extra_body=scheme)
assert c.object == "text_completion", c
assert c.choices[0].finish_reason in ("length", "stop"), c
assert c.usage.completion_tokens <= 16 and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens, c
passed += 1

# Completions, streamed: the deltas add up to the unary text (greedy), usage at the end.
chunks = list(client.completions.create(model="llada", prompt="You may copy", max_tokens=16,
                                        temperature=0, extra_body=scheme, stream=True,
                                        stream_options={"include_usage": True}))
text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
assert text == c.choices[0].text, (text, c.choices[0].text)
assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == c.usage.completion_tokens, chunks[-1]
passed += 1

# Chat, unary and streamed (the checkpoint's chat template), WINO through extra_body.
msgs = [{"role": "user", "content": "Hello there"}]
wino = {"wino": {"block_length": 8}}
r = client.chat.completions.create(model="llada", messages=msgs, max_tokens=16, temperature=0,
                                   extra_body=wino)
assert r.object == "chat.completion" and r.choices[0].message.role == "assistant", r
stream = client.chat.completions.create(model="llada", messages=msgs, max_tokens=16, temperature=0,
                                        extra_body=wino, stream=True)
deltas = [ch.choices[0].delta for ch in stream if ch.choices]
assert deltas[0].role == "assistant", deltas[0]
assert "".join(d.content or "" for d in deltas) == r.choices[0].message.content
passed += 1

# An invalid parameter: a 400 with OpenAI's error object and a message naming it.
try:
    client.completions.create(model="llada", prompt="x", max_tokens=10,
                              extra_body={"low_confidence": {"block_length": 4, "steps": 5}})
    raise SystemExit("steps that do not split over the blocks were accepted")
except openai.BadRequestError as e:
    assert "low_confidence.steps" in e.message, e.message
# max_tokens is a cap: blocks that do not fill it are served, and the answer stops there.
r = client.completions.create(model="llada", prompt="x", max_tokens=10, temperature=0,
                              extra_body={"low_confidence": {"block_length": 4}})
assert r.usage.completion_tokens <= 10, r.usage
# n completions: one choice each, indexed, the completions' tokens summed in the usage.
r = client.completions.create(model="llada", prompt="x", n=2, max_tokens=8, seed=3,
                              extra_body={"low_confidence": {"block_length": 4}})
assert [c.index for c in r.choices] == [0, 1], r.choices
assert r.usage.completion_tokens <= 16, r.usage
try:
    client.completions.create(model="llada", prompt="x", n=17)
    raise SystemExit("n=17 was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "n", e.body
try:
    client.completions.create(model="nope", prompt="x")
    raise SystemExit("an unknown model was accepted")
except openai.NotFoundError:
    pass
passed += 1


# Log-probabilities: chat's content list (token, logprob, bytes, top_logprobs) and completions'
# legacy lists, one entry per generated token, streamed chunks adding up to the unary answer.
r = client.chat.completions.create(model="llada", messages=msgs, max_tokens=16, temperature=0,
                                   extra_body=wino, logprobs=True, top_logprobs=2)
content = r.choices[0].logprobs.content
assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
for t in content:
    assert t.logprob <= 0 and len(t.top_logprobs) == 2, t
    assert t.bytes == list(t.token.encode()), t
    assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob, t
stream = client.chat.completions.create(model="llada", messages=msgs, max_tokens=16, temperature=0,
                                        extra_body=wino, logprobs=True, top_logprobs=2, stream=True)
streamed = [t.logprob for ch in stream if ch.choices and ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.content]
assert streamed == [t.logprob for t in content], (streamed, content)
c = client.completions.create(model="llada", prompt="You may copy", max_tokens=16, temperature=0,
                              extra_body=scheme, logprobs=3)
lp = c.choices[0].logprobs
assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens, lp
assert all(1 <= len(m) <= 3 for m in lp.top_logprobs), lp.top_logprobs
# echo with max_tokens 0: the prompt's entries (LLaDA's bound, each token a one-token answer),
# the first null, as evaluation harnesses read them; the Monte Carlo bound through `likelihood`.
e = client.completions.create(model="llada", prompt="You may copy", max_tokens=0, echo=True,
                              logprobs=1, seed=2)
lp = e.choices[0].logprobs
assert e.choices[0].text.startswith("You may copy") or len(lp.tokens) > 1, e
assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:]), lp
assert e.usage.completion_tokens == 0, e.usage
b = client.completions.create(model="llada", prompt="You may copy", max_tokens=0, echo=True,
                              logprobs=0, seed=2,
                              extra_body={"likelihood": {"context_tokens": 1, "mc_samples": 8}})
bl = b.choices[0].logprobs.token_logprobs
assert bl[0] is None and len(bl) == len(lp.token_logprobs), bl
# Structured outputs: OpenAI's response_format (json_schema, strict) and vLLM's
# structured_outputs; the text parses and validates.
schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
r = client.chat.completions.create(
    model="llada", messages=msgs, max_tokens=24, temperature=0,
    response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}},
    extra_body={"low_confidence": {"block_length": 24, "steps": 24}})
obj = json.loads(r.choices[0].message.content)
assert set(obj) == {"n"} and isinstance(obj["n"], int) and 0 <= obj["n"] <= 99, obj
c = client.completions.create(model="llada", prompt="x", max_tokens=8, temperature=0,
                              extra_body={"structured_outputs": {"choice": ["yes", "no"]},
                                          "low_confidence": {"block_length": 8, "steps": 8}})
assert c.choices[0].text in ("yes", "no"), c.choices[0].text
try:
    client.completions.create(model="llada", prompt="x", max_tokens=8,
                              extra_body={"structured_outputs": {"regex": "([a-z"}})
    raise SystemExit("an invalid regex was accepted")
except openai.BadRequestError as e:
    assert "structured_output" in e.message, e.message
try:
    client.chat.completions.create(model="llada", messages=msgs, top_logprobs=2)
    raise SystemExit("top_logprobs without logprobs was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "top_logprobs", e.body
passed += 1


def gauge(name):
    body = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


# A cancelled stream frees its slots: read one chunk of a long request, close the stream.
stream = client.completions.create(model="llada", prompt="You may copy", max_tokens=256,
                                   extra_body={"low_confidence": {"block_length": 8}}, stream=True)
next(iter(stream))
stream.close()
deadline = time.time() + 20
while not (gauge("wavefront_slots_used") == 0 and gauge("wavefront_active_requests") == 0):
    assert time.time() < deadline, (gauge("wavefront_slots_used"), gauge("wavefront_active_requests"))
    time.sleep(0.05)
passed += 1

# Reflection v1alpha, as grpcio-reflection and older grpcurl ask for it.
stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(grpc_addr))
reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                       timeout=30))
names = [s.name for s in reply.list_services_response.service]
assert "wavefront.v1.Generation" in names and "wavefront.worker.v1.Worker" not in names, names
passed += 1

print(f"openai client and reflection: {passed} passed, 0 failed")
