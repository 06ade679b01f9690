"""Models built on weft's layers: a tensor- and pipeline-parallel Llama-3 / Qwen3 decoder (`from_hf`), with generation."""
from .decoder import DecodeSession, KVCache, ModelConfig, Stage, Transformer, from_hf, sample

__all__ = ["from_hf", "Transformer", "ModelConfig", "KVCache", "DecodeSession", "Stage", "sample"]
