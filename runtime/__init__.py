"""What eval/ and train/ both need to run a model, below both: which weights a name means
(resolve), LoRA adapters, GGUF conversion and the CPU threads torch runs on."""
