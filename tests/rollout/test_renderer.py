from actloop.train.offline.pairs import masked_spans
from actloop.rollout.renderer import Renderer, parse_tool_calls
from actloop.types import Message, Trajectory, Turn


def test_parse_hermes_tool_call():
    p = parse_tool_calls('ok <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>')
    assert p.error is None and p.calls[0].name == "calculator" and p.calls[0].arguments == {"expression": "1+2"}


def test_parse_arguments_as_json_string():
    p = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert p.error is None and p.calls[0].arguments == {"x": 1}


def test_parse_malformed_calls_report_errors():
    assert "not valid JSON" in parse_tool_calls("<tool_call>{name: calculator}</tool_call>").error
    assert "not closed" in parse_tool_calls('<tool_call>{"name": "f"}').error
    assert "string \"name\"" in parse_tool_calls('<tool_call>[1, 2]</tool_call>').error
    assert "JSON object" in parse_tool_calls('<tool_call>{"name": "f", "arguments": 3}</tool_call>').error
    assert parse_tool_calls("no call here").calls == ()


def test_tool_results_become_a_user_turn_without_a_tool_role(tokenizer):
    r = Renderer(tokenizer)
    assert not r.format.has_tool_role  # SmolLM2's template has no tool role
    text = r.continuation_text([Message("tool", "391", name="calculator")], ended_with_eos=True)
    assert text == "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # a turn cut at the stop string did not sample its <|im_end|>: the renderer closes it
    assert r.continuation_text([], ended_with_eos=False).startswith("<|im_end|>")


def test_loss_mask_decodes_to_exactly_the_assistant_turns(tokenizer):
    """Render a 2-turn episode the way the rollout loop does and check the mask."""
    r = Renderer(tokenizer)
    prompt = [Message("system", "sys"), Message("user", "What is 12 * 13?")]
    prompt_ids = r.prompt_ids(prompt)
    texts = ['<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 13"}}</tool_call>',
             "The answer is 156."]
    turn1_ids = r.encode(texts[0])  # cut at the stop string: no EOS sampled
    env = [Message("tool", "156", name="calculator")]
    env_ids = r.continuation_ids(env, ended_with_eos=False)
    turn2_ids = r.encode(texts[1]) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    traj = Trajectory(
        prompt_messages=tuple(prompt), prompt_ids=tuple(prompt_ids),
        turns=(Turn(Message("assistant", texts[0]), tuple(turn1_ids), (0.0,) * len(turn1_ids), "tool_call",
                    tuple(env), tuple(env_ids)),
               Turn(Message("assistant", texts[1]), tuple(turn2_ids), (0.0,) * len(turn2_ids), "stop")),
    )
    ids, mask = traj.input_ids, traj.loss_mask
    assert len(ids) == len(mask) == len(traj.logprobs)
    spans = masked_spans(ids, mask)
    assert [r.decode(s) for s in spans] == [texts[0], texts[1] + "<|im_end|>"]
    # and the whole sequence is what the chat template renders for that conversation
    full = r.history_text(traj.messages)
    assert r.decode(ids) == full.rstrip("\n")  # the template ends its last turn with a newline


def test_assistant_message_strips_eos_and_parses(tokenizer):
    r = Renderer(tokenizer)
    ids = r.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>')
    msg, parsed = r.assistant_message(ids + [r.eos_token_ids[0]])
    assert msg.content.endswith("</tool_call>") and parsed.calls[0].arguments["expression"] == "2*3"
