"""LLM serving: Hugging Face-format GPT-2/Llama decoders (model.py) and their tokenizers
(tokenizer.py).

The forward is written once (forward.py) over micro-ops that torch runs eagerly (the reference,
`forward_tokens`) or that a device program records (device_step.py); the engine (engine.py) batches
requests continuously and runs each step as one program.
"""

from serving.llm.forward import forward_tokens
from serving.llm.model import (
    KVCache,
    KVCacheFullError,
    Model,
    ModelConfig,
    ModelLoadError,
    Weights,
    create_tiny_model,
    load_model,
)
from serving.llm.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "KVCache",
    "KVCacheFullError",
    "Model",
    "ModelConfig",
    "ModelLoadError",
    "Tokenizer",
    "Weights",
    "create_tiny_model",
    "forward_tokens",
    "load_model",
    "load_tokenizer",
]
