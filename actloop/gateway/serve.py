"""`actloop serve MODEL_OR_RUN_DIR [--port N]`: the gateway outside training.

Any OpenAI client can then talk to a trained model (or use it as an LLM judge): the same
endpoints, chat format and tool-call parsing as during training, with the client's own
sampling settings, no sessions and nothing captured.
"""

from __future__ import annotations

from pathlib import Path

from actloop.config import load_config
from actloop.gateway.agent import model_context
from actloop.gateway.chat import ChatFormat
from actloop.gateway.server import Gateway, SamplingPolicy
from actloop.models import load_models
from actloop.rollout.factory import make_engine
from actloop.rollout.renderer import Renderer


def model_path(spec: str) -> str:
    """A run directory serves its final model; anything else is a model spec (actloop.models)."""
    final = Path(spec) / "final"
    return str(final) if (final / "config.json").exists() else spec


def build(spec: str, name: str | None = None, max_new_tokens: int = 512, precision: str = "auto",
          max_context: int = 0, engine: str = "auto") -> Gateway:
    """The gateway over the engine `engine` names (rollout.engine: auto = vLLM where installed)."""
    path = model_path(spec)
    cfg = load_config(None, [f"model={path}", f"train.precision={precision}", f"rollout.engine={engine}"])
    models = load_models(path)
    renderer = Renderer(models.tokenizer)
    engine = make_engine(cfg, models, renderer)
    del models.policy  # the engine holds its own copy
    names = tuple(dict.fromkeys([name or "policy", spec, path]))
    return Gateway(engine, ChatFormat(renderer), names, max_context or model_context(engine),
                   SamplingPolicy(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, fixed=False))
