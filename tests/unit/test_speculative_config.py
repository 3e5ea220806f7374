"""vLLM's ``speculative_config`` dict, checked naming the field."""

from __future__ import annotations

import re

import pytest

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.speculative_config import SpeculativeConfig


def test_prompt_lookup_and_draft_model_configs():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == (
        "ngram",
        3,
        4,
    )
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2}).method == "ngram"
    # A model without a method is a draft model, as in vLLM.
    config = SpeculativeConfig.from_dict({"model": "/m/draft", "num_speculative_tokens": 5})
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model",
        "/m/draft",
        5,
    )
    explicit = {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 5}
    assert SpeculativeConfig.from_dict(explicit) == config
    limited = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "disable_by_batch_size": 8})
    assert limited.disable_by_batch_size == 8
    # The model's own multi-token-prediction layer, under vLLM's names old and new.
    for method in ("mtp", "deepseek_mtp", "glm4_moe_mtp"):
        config = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 1})
        assert (config.method, config.model) == ("mtp", None)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"num_speculative_tokens": 3, "method": "eagle"}, "speculative_config.method"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 3, "draft_model": "x"}, "unknown key(s) draft_model"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min (5)"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2},
            "speculative_config.model (the draft model's directory or GGUF file) is required",
        ),
        (
            {"method": "draft_model", "model": "", "num_speculative_tokens": 2},
            "speculative_config.model",
        ),
        (
            {"method": "ngram", "model": "/m/draft", "num_speculative_tokens": 2},
            "speculative_config.model ('/m/draft') is for method 'draft_model'",
        ),
        (
            {"model": "/m/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            "prompt_lookup_max apply to method 'ngram'",
        ),
        (
            {"method": "mtp", "model": "/m/draft", "num_speculative_tokens": 1},
            "method 'mtp' drafts with the target's own multi-token-prediction layer",
        ),
        (
            {"method": "deepseek_mtp", "num_speculative_tokens": 1, "prompt_lookup_min": 2},
            "prompt_lookup_min apply to method 'ngram' (prompt lookup), not to 'mtp'",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 1},
            "speculative_config.draft_tensor_parallel_size is for method 'draft_model'",
        ),
        (
            {"num_speculative_tokens": 2, "disable_by_batch_size": 1},
            "speculative_config.disable_by_batch_size must be an integer >= 2 (or null), got 1",
        ),
        (
            {"num_speculative_tokens": 2, "disable_by_batch_size": "8"},
            "speculative_config.disable_by_batch_size must be an integer >= 2",
        ),
        (
            {"model": "/m/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0},
            "speculative_config.draft_tensor_parallel_size must be an integer >= 1",
        ),
        (
            {"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "speculative_config.draft_tensor_parallel_size is for method 'draft_model'",
        ),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(config, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SpeculativeConfig.from_dict(config)


def test_the_scheduler_config_checks_its_speculation_fields():
    with pytest.raises(ValueError, match="allocation_policy 'paged'"):
        SchedulerConfig(num_speculative_tokens=2, allocation_policy="max", max_model_len=64)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0"):
        SchedulerConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative_method must be one of ngram, draft_model"):
        SchedulerConfig(num_speculative_tokens=2, speculative_method="eagle")
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size must be 0"):
        SchedulerConfig(num_speculative_tokens=2, speculative_disable_by_batch_size=1)
