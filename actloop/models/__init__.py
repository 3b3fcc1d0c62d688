from actloop.models.resolve import ModelError, Models, load_models, load_tokenizer, resolve_model

__all__ = ["ModelError", "Models", "load_models", "load_tokenizer", "resolve_model"]
