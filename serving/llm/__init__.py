"""LLM serving: Hugging Face-format GPT-2/Llama decoders (model.py) and their tokenizers (tokenizer.py).

The engine (continuous batching through the runtime) builds on `Model`'s per-layer functions and
checks itself against `Model.forward`, the plain torch reference.
"""
from serving.llm.model import (KVCache, KVCacheFullError, Model, ModelConfig, ModelLoadError, Weights,
                               create_tiny_model, load_model)
from serving.llm.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "KVCache", "KVCacheFullError", "Model", "ModelConfig", "ModelLoadError",
           "Tokenizer", "Weights", "create_tiny_model", "load_model", "load_tokenizer"]
