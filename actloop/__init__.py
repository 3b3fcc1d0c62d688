"""actloop: agentic reinforcement learning of open LLMs."""

__version__ = "0.1.0"
