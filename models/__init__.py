"""Model families as pure JAX functions over a params pytree (llama, qwen3, phi3, gemma3; the
seam is models/families.py), their shared building blocks, checkpoint loaders (GGUF, Hugging
Face safetensors, Orbax cache), tokenizers, chat templates, LoRA, int8 weights and the dense
generate loop that is the engine's correctness oracle."""
