"""The policy network and how it is stored: gpt.py (one decoder for Llama / Qwen2 / Qwen3),
hf_folder.py (the Hugging Face folder format it loads from and saves to), tokenizer.py (the
tokenizers and their chat template), lora.py (LoRA adapters and their PEFT folders)."""
