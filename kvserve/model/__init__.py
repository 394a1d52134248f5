"""Model runtime: loaders, the Llama-family forward pass, the paged KV cache tensors."""
