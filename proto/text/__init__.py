"""Text ↔ tokens without torch: the tokenizer, the chat template and the streaming
detokenizer, shared by the engine and by every ingress."""
