"""Sequence classification models (HF's ``*ForSequenceClassification``, vLLM's classify
task) equal HF transformers on the same weights (float32): each prompt's last token's
final hidden state through the ``score`` head, then a softmax over the labels (a sigmoid
for one label). A one-label model is a cross-encoder: ``LLM.score`` joins each pair as the
tokenizer joins a pair and scores it with the sigmoid of its logit."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from helpers.family_configs import (
    ARCEE,
    DEEPSEEK_CONFIGS,
    EXAONE4,
    GEMMA_CONFIGS,
    GLM4,
    GPT_OSS,
    HUNYUAN,
    MINISTRAL3,
    NEMOTRON,
    OLMO2,
    OLMO3,
    PHI3,
    SEED_OSS,
    SMOLLM3,
    STARCODER2,
)
from helpers.pooling_models import LABELS, classifier_config, make_cross_encoder
from helpers.tiny_models import TINY_CONFIGS, random_hf_model
from helpers.tiny_tokenizers import BYTE_LEVEL_SPECIALS
from pagedserve.frontend import LLM, PoolingParams, SamplingParams
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.pooling_params import check_task

# With 16-token blocks and a 64-token budget: one token, part of a block, a block and one,
# and prompts of two and three chunks; the last shares three full blocks with the 100-token one.
LENGTHS = [1, 5, 17, 100, 150]
FAMILIES = {
    "llama": TINY_CONFIGS["llama"],
    "qwen3": TINY_CONFIGS["qwen3"],
    "opt": TINY_CONFIGS["opt"],
    "gemma2": GEMMA_CONFIGS["gemma2"],
    # No pad token: HF's generic classifier would pool before a prompt's last 0 otherwise.
    "phi3": {**PHI3, "pad_token_id": None},
    "olmo2": {**OLMO2, "pad_token_id": None},
    "olmo3": {**OLMO3, "pad_token_id": None},
    "smollm3": {**SMOLLM3, "pad_token_id": None},
    "starcoder2": STARCODER2,
    "glm4": {**GLM4, "pad_token_id": None},
    "gpt_oss": {**GPT_OSS, "pad_token_id": None},
    "seed_oss": {**SEED_OSS, "pad_token_id": None},
    "arcee": {**ARCEE, "pad_token_id": None},
    "deepseek_v3": {**DEEPSEEK_CONFIGS["v3"], "pad_token_id": None},
    "exaone4": {**EXAONE4, "pad_token_id": None},
    "hunyuan": {**HUNYUAN, "pad_token_id": None},
    "nemotron": {**NEMOTRON, "pad_token_id": None},
    "ministral3": {**MINISTRAL3, "pad_token_id": None},
}


def prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    ids = [[rng.randrange(512) for _ in range(n)] for n in LENGTHS]
    return [*ids, ids[3][:48] + [rng.randrange(512) for _ in range(9)]]


def hf_logits(model_dir, token_lists: list[list[int]]) -> list[torch.Tensor]:
    """HF's classifier logits, one prompt at a time (no padding: its last token pools)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32
    )
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in token_lists]


def assert_close(values: list[float], expected: torch.Tensor) -> None:
    actual = torch.tensor(values, dtype=torch.float32)
    assert actual.shape == expected.shape
    assert torch.allclose(actual, expected, atol=1e-5, rtol=1e-4), (actual - expected).abs().max()


@pytest.fixture(scope="module")
def classifier_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("classifiers")
    return {
        family: random_hf_model(classifier_config(causal, id2label=LABELS), root / family)
        for family, causal in FAMILIES.items()
    }


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return make_cross_encoder(tmp_path_factory.mktemp("cross_encoder"))


def chunked_llm(model_dir, **kwargs) -> LLM:
    return LLM(model_dir, block_size=16, num_blocks=128, max_num_batched_tokens=64, **kwargs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_classifications_match_hf_with_chunked_prefill_and_prefix_hits(classifier_dirs, family):
    model_dir = classifier_dirs[family]
    expected = hf_logits(model_dir, prompts())
    llm = chunked_llm(model_dir)
    assert llm.model_config.labels == ("negative", "neutral", "positive")
    first = llm.classify(prompts())
    # Again: the full blocks now come from the prefix cache.
    second = llm.classify(prompts())
    for outputs in (first, second):
        for output, logits, token_ids in zip(outputs, expected, prompts()):
            assert output.prompt_token_ids == token_ids
            assert output.outputs.num_classes == 3
            assert_close(output.outputs.probs, logits.softmax(dim=0))
            assert output.label == LABELS[int(logits.argmax())]
    assert [o.num_cached_tokens for o in second] == [0, 0, 16, 96, 144, 48]
    raw = llm.classify(prompts(), PoolingParams(task="classify", use_activation=False))
    for output, logits in zip(raw, expected):
        assert_close(output.outputs.probs, logits)
    assert llm.stats()["num_sampled_tokens"] == 0


def test_a_classifier_serves_only_classification(classifier_dirs, tiny_model_dirs):
    classifier = chunked_llm(classifier_dirs["llama"])
    with pytest.raises(ValueError, match="LlamaForSequenceClassification: .*not the generate task"):
        classifier.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="not the embed task"):
        classifier.embed([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"score.*3 labels \(negative, neutral, positive\)"):
        classifier.score("a", ["b"])
    with pytest.raises(ValueError, match=r"pooling_params.task='embed': classify\(\) takes"):
        classifier.classify([[1, 2]], PoolingParams())
    causal = chunked_llm(tiny_model_dirs["llama"])
    with pytest.raises(ValueError, match="LlamaForCausalLM: .*no classifier head"):
        causal.classify([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"pooling_params.task='classify': embed\(\) takes"):
        causal.embed([[1, 2]], PoolingParams(task="classify"))
    # Nothing was queued: both still answer.
    assert classifier.classify([[4, 5]])[0].outputs.num_classes == 3
    assert len(causal.generate([[4, 5]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids)


def test_the_scheduler_refuses_a_request_of_another_task():
    """The engine process repeats the frontend's check: a client of the engine socket
    cannot make a classifier sample (it has no LM head)."""
    with pytest.raises(ValueError, match="not the generate task"):
        check_task(SchedulerConfig(model_task="classify").model_task, None)
    with pytest.raises(ValueError, match="no classifier head"):
        check_task("generate", PoolingParams(task="classify"))
    check_task("classify", PoolingParams(task="classify"))
    check_task("generate", PoolingParams())
    with pytest.raises(ValueError, match="model_task must be one of generate, classify"):
        SchedulerConfig(model_task="rank")


def test_a_multiprocess_engine_classifies_as_the_offline_one(classifier_dirs):
    """PoolingParams' task and activation cross to the scheduler and worker processes;
    the scheduler refuses a generation request on its own check too."""
    model_dir = classifier_dirs["qwen3"]
    expected = hf_logits(model_dir, prompts())
    with chunked_llm(model_dir, multiprocess=True) as llm:
        outputs = llm.classify(prompts(), PoolingParams(task="classify", use_activation=False))
        for output, logits in zip(outputs, expected):
            assert_close(output.outputs.probs, logits)
        llm.engine.add_request("sneaky", [1, 2, 3], SamplingParams(max_tokens=2), frozenset())
        with pytest.raises(ValueError, match="not the generate task"):
            while True:
                llm.engine.step(wait_when_idle=True)
        llm.check_integrity()


def test_labels_come_from_id2label_or_num_labels(tmp_path, classifier_dirs):
    config = ModelConfig.from_dir(classifier_dirs["opt"])
    assert config.architecture == "OPTForCausalLM" and config.task == "classify"
    assert config.declared_architecture == "OPTForSequenceClassification"
    import json
    import shutil

    for fields, labels in [
        ({"id2label": None, "num_labels": 4}, ("LABEL_0", "LABEL_1", "LABEL_2", "LABEL_3")),
        ({"id2label": None}, ("LABEL_0", "LABEL_1")),
    ]:
        path = tmp_path / str(len(labels))
        shutil.copytree(classifier_dirs["llama"], path)
        hf_config = json.loads((path / "config.json").read_text())
        hf_config.pop("label2id", None)
        hf_config.update(fields)
        (path / "config.json").write_text(json.dumps(hf_config))
        assert ModelConfig.from_dir(path).labels == labels
    hf_config["id2label"] = {"0": "a", "2": "c"}
    (path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ValueError, match="id2label must map the label ids 0 to n - 1"):
        ModelConfig.from_dir(path)


def test_cross_encoder_scores_match_hf(cross_encoder_dir):
    query = "what is paged attention?"
    documents = ["blocks of keys and values", "a recipe for bread", "paged attention pages"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder_dir)
    pairs = [hf_tokenizer(query, text_pair=d)["input_ids"] for d in documents]
    start, end = hf_tokenizer.convert_tokens_to_ids(list(BYTE_LEVEL_SPECIALS[1:]))
    assert pairs[0][0] == start and end in pairs[0]  # the tokenizer's pair template
    expected = [torch.sigmoid(logit) for logit in hf_logits(cross_encoder_dir, pairs)]
    llm = chunked_llm(cross_encoder_dir)
    outputs = llm.score(query, documents)
    assert [o.prompt_token_ids for o in outputs] == pairs
    for output, score in zip(outputs, expected):
        assert abs(output.outputs.score - float(score)) < 1e-5
        assert 0.0 <= output.outputs.score <= 1.0
    # Pairwise, and truncated: HF's longest_first cut of the pair to 12 tokens.
    pairwise = llm.score([query, "bread"], documents[:2], truncate_prompt_tokens=12)
    cut = [
        hf_tokenizer(a, text_pair=b, truncation=True, max_length=12)["input_ids"]
        for a, b in [(query, documents[0]), ("bread", documents[1])]
    ]
    assert [o.prompt_token_ids for o in pairwise] == cut
    for output, logit in zip(pairwise, hf_logits(cross_encoder_dir, cut)):
        assert abs(output.outputs.score - float(torch.sigmoid(logit))) < 1e-5
    with pytest.raises(ValueError, match=r"data_2\[0\]: a cross-encoder scores texts"):
        llm.score(query, [[1, 2, 3]])


def test_tensor_parallel_ranks_classify_as_one(classifier_dirs):
    """Every rank holds the whole head and the whole final hidden state: two ranks give
    one rank's probabilities."""
    model_dir = classifier_dirs["llama"]
    expected = hf_logits(model_dir, prompts())
    with chunked_llm(model_dir, tensor_parallel_size=2) as llm:
        for output, logits in zip(llm.classify(prompts()), expected):
            assert_close(output.outputs.probs, logits.softmax(dim=0))
