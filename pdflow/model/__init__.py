"""Model definitions (GQA decoders), checkpoint loading and tokenizers."""

from pdflow.model.paths import resolve_model_path

__all__ = ["resolve_model_path"]
