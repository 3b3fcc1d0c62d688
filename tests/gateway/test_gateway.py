"""The gateway with the real `openai` client on loopback: token-exact capture, segments, errors."""

import json

import httpx
import openai
import pytest

CALC = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                          "parameters": {"type": "object",
                                                         "properties": {"expression": {"type": "string"}}}}}]


def _call(expr):
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expr


def _tool_loop(client, question, calls=3):
    """A plain tool loop: call, run the tool calls, send the results back, `calls` times."""
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": question}]
    replies = []
    for _ in range(calls):
        resp = client.chat.completions.create(model="policy", messages=messages, tools=CALC,
                                              extra_body={"return_token_ids": True})
        replies.append(resp)
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for tc in msg.tool_calls or []:
            expr = json.loads(tc.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": str(eval(expr))})
    return messages, replies


def test_three_call_conversation_is_one_trajectory_with_the_sampled_ids(scripted):
    gw, eng = scripted
    eng.replies = [_call("23 * 17"), "Let me add. " + _call("391 + 9"), "The answer is 400."]
    sid, base = gw.open_session()
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    messages, replies = _tool_loop(client, "What is 23*17+9?")
    assert [r.choices[0].finish_reason for r in replies] == ["tool_calls", "tool_calls", "stop"]
    assert replies[1].choices[0].message.content == "Let me add."
    assert replies[1].choices[0].message.tool_calls[0].function.name == "calculator"
    cap = gw.close_session(sid)
    (traj,) = cap.trajectories({})
    assert cap.stats()["extensions"] == 2 and cap.stats()["segments"] == 1
    # training ids = sampled ids, token by token, in order
    trained = [i for i, m in zip(traj.input_ids, traj.loss_mask) if m]
    assert trained == [t for s in eng.sampled for t in s]
    assert [list(t.token_ids) for t in traj.turns] == eng.sampled
    # each call's prompt is exactly the trajectory up to that call (the engine saw those ids)
    for k, prompt in enumerate(eng.prompts):
        n = len(traj.prompt_ids) + sum(len(t.token_ids) + len(t.env_ids) for t in traj.turns[:k])
        assert traj.input_ids[:n] == prompt
    assert [r.prompt_token_ids for r in replies] == eng.prompts  # return_token_ids, as vLLM names it
    # the tool results went in as masked env tokens
    assert all(t.env_ids for t in traj.turns[:2]) and "391" in gw.fmt.decode(traj.turns[0].env_ids)


def test_agent_that_edits_its_history_becomes_two_segments(scripted):
    gw, eng = scripted
    eng.replies = ["First draft.", "Second try.", "Third."]
    sid, base = gw.open_session()
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Write a line."}]
    r1 = client.chat.completions.create(model="policy", messages=msgs)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "Again."}]
    client.chat.completions.create(model="policy", messages=msgs)  # extends
    edited = [{"role": "user", "content": "Write a line, briefly."}]  # the agent rewrote its history
    client.chat.completions.create(model="policy", messages=edited)
    cap = gw.close_session(sid)
    s = cap.stats()
    assert (s["calls"], s["extensions"], s["segments"], s["new_segments"]) == (3, 1, 2, 1)
    first, second = cap.trajectories({})
    assert len(first.turns) == 2 and len(second.turns) == 1
    assert [i for i, m in zip(second.input_ids, second.loss_mask) if m] == eng.sampled[2]


def test_drift_is_counted_and_the_sampled_ids_win(scripted):
    gw, eng = scripted
    # spacing the template would not reproduce: re-rendering gives other ids than were sampled
    eng.replies = ['<tool_call>{"name":"calculator","arguments":{"expression":"1+1"}}</tool_call>', "2."]
    sid, base = gw.open_session()
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    _tool_loop(client, "1+1?", calls=2)
    cap = gw.close_session(sid)
    assert cap.stats()["drift"] == 1 and cap.stats()["extensions"] == 1
    (traj,) = cap.trajectories({})
    assert list(traj.turns[0].token_ids) == eng.sampled[0]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(scripted):
    gw, eng = scripted
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    ok = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-5", messages=ok)
    with pytest.raises(openai.BadRequestError, match="role must be one of"):
        client.chat.completions.create(model="policy", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        client.chat.completions.create(model="policy", messages=[])
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "word " * 3000}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="parameters must be a JSON schema"):
        client.chat.completions.create(model="policy", messages=ok, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\]"):
        client.chat.completions.create(model="policy", messages=ok, tools=[{"type": "retrieval"}])
    r = httpx.post(gw.url + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(gw.url + "/s/nope/v1/chat/completions", json={"model": "policy", "messages": ok}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert gw.errors == 8
    eng.replies = ["still here"]
    assert client.chat.completions.create(model="policy", messages=ok).choices[0].message.content == "still here"
    assert [m.id for m in client.models.list().data] == ["policy"]


def test_streaming_and_completions(scripted):
    gw, eng = scripted
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    eng.replies = ["Hello " + _call("2*3")]
    chunks = list(client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                                 tools=CALC, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert text == "Hello" and calls[0].function.name == "calculator"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(eng.sampled[-1])
    eng.replies = [" world"]
    ids = gw.fmt.encode("Hello")
    r = client.completions.create(model="policy", prompt=ids, max_tokens=8, logprobs=0,
                                  extra_body={"return_token_ids": True})
    assert eng.prompts[-1] == ids
    assert r.choices[0].token_ids == eng.sampled[-1] and r.choices[0].logprobs.token_logprobs == [-0.5] * len(
        eng.sampled[-1])
    assert r.choices[0].text.startswith(" world")


def test_tool_choice_required_or_named_makes_the_reply_a_call(scripted):
    gw, eng = scripted
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    ask = [{"role": "user", "content": "What is 2*3?"}]
    # named: the reply opens with `<tool_call>{"name": "calculator", "arguments": `; the model writes the rest
    eng.replies = ['{"expression": "2*3"}}</tool_call>']
    r = client.chat.completions.create(model="policy", messages=ask, tools=CALC,
                                       tool_choice={"type": "function", "function": {"name": "calculator"}})
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "2*3"})
    assert r.choices[0].finish_reason == "tool_calls"
    assert eng.prompts[-1][-len(gw.fmt.encode('<tool_call>{"name": "calculator", "arguments": ')):] == \
        gw.fmt.encode('<tool_call>{"name": "calculator", "arguments": ')
    # required: the call opening only; a model that would have answered in prose must still call
    eng.replies = ['{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>']
    r = client.chat.completions.create(model="policy", messages=ask, tools=CALC, tool_choice="required")
    assert r.choices[0].message.tool_calls[0].function.name == "calculator"
    # auto: whatever the model says
    eng.replies = ["Six."]
    r = client.chat.completions.create(model="policy", messages=ask, tools=CALC, tool_choice="auto")
    assert r.choices[0].message.content == "Six." and not r.choices[0].message.tool_calls


@pytest.mark.slow
def test_serve_answers_a_real_client_with_the_embedded_model():
    from actloop.gateway.serve import build

    gw = build("smollm2-135m-instruct", max_new_tokens=16)
    gw.start()
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Say hello."}],
                                           temperature=0, max_tokens=8, logprobs=True)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 8
        assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
        again = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=8,
                                               messages=[{"role": "user", "content": "Say hello."}])
        assert again.choices[0].message.content == r.choices[0].message.content  # greedy: the same reply
        assert gw.engine.inner.stats["reused_tokens"] > 0  # the second prompt came from the prefix cache
    finally:
        gw.stop()
        gw.engine.close()
