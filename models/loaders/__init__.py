"""Checkpoint loaders: GGUF, Hugging Face safetensors directories, and an Orbax cache.

Each returns (ModelConfig, Params as float32/bfloat16 numpy-backed jax arrays). Weights are
converted to the Hugging Face layout (llama.cpp's Q/K permutation undone) so one model
function serves every source.
"""
