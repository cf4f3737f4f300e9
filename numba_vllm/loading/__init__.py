"""Checkpoints from disk: discovery (`checkpoint.py`), safetensors, bf16, the tokenizer and chat
template, and GGUF files (`gguf/`). No GPU import."""
