"""A scripted engine for driving environments without a model (see tests/rollout/test_episodes.py)."""

import pytest

from actloop.rollout.engine import Completion, EngineBase


class ScriptedEngine(EngineBase):
    """Call i answers with script[i]: one text for every active row, or a list with one text per
    active row. Ids come from the tokenizer; a reply ending in </tool_call> stops there, any other
    ends with EOS."""

    def __init__(self, renderer, script):
        self.r, self.script, self.calls = renderer, list(script), 0

    def generate(self, prompts, params):
        texts = self.script[self.calls]
        self.calls += 1
        texts = [texts] * len(prompts) if isinstance(texts, str) else texts
        assert len(texts) == len(prompts), (len(texts), len(prompts))
        out = []
        for text in texts:
            ids = self.r.encode(text)
            stop = text.endswith("</tool_call>")
            if not stop:
                ids = ids + [self.r.eos_token_ids[0]]
            out.append(Completion(tuple(ids), tuple([-0.5] * len(ids)), "stop_string" if stop else "stop"))
        return out

    def sync_weights(self, model):
        pass


@pytest.fixture
def scripted():
    return ScriptedEngine


@pytest.fixture(scope="session")
def renderer(tokenizer):
    from actloop.rollout.renderer import Renderer

    return Renderer(tokenizer)
