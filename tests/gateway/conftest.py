import pytest

from actloop.gateway.chat import ChatFormat
from actloop.gateway.server import Gateway, SamplingPolicy
from actloop.rollout.engine import Completion, EngineBase
from actloop.rollout.renderer import Renderer

openai = pytest.importorskip("openai", reason="the gateway tests need the `agents` extra (openai, fastapi, uvicorn)")
pytest.importorskip("fastapi", reason="the gateway needs the `agents` extra")


class ScriptedEngine(EngineBase):
    """Answers each request with the next scripted reply, tokenized: a deterministic 'policy' for
    the gateway's own tests (the embedded model's tests are marked slow). Records every prompt."""

    def __init__(self, tokenizer, replies, eos_id):
        self.tok, self.replies, self.eos = tokenizer, list(replies), eos_id
        self.prompts, self.sampled = [], []
        self.generated_tokens = 0

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.replies.pop(0) if self.replies else "ok"
            ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
            ids = ids[: params.max_new_tokens - 1] + [self.eos]
            self.prompts.append(list(p))
            self.sampled.append(ids)
            self.generated_tokens += len(ids)
            out.append(Completion(tuple(ids), tuple(-0.5 for _ in ids), "stop"))
        return out

    def sync_weights(self, model):
        pass


@pytest.fixture
def scripted(tokenizer):
    r = Renderer(tokenizer)
    eng = ScriptedEngine(tokenizer, [], r.eos_token_ids[-1] if len(r.eos_token_ids) else tokenizer.eos_token_id)
    eng.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    gw = Gateway(eng, ChatFormat(r), ("policy",), 2048, SamplingPolicy(max_new_tokens=64))
    gw.start()
    yield gw, eng
    gw.stop()
