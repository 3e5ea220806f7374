"""The worker: model, KV cache tensors, model runner, sampler and op wrappers."""
