"""The scheduler: requests, KV block accounting and iteration-level batching.

Pure Python: nothing here imports torch, so the scheduler process stays light and its
policy is unit-testable without a model.
"""
