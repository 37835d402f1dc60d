"""Model families (Llama, Mistral, Qwen2) and their loading from checkpoints and GGUF files."""
