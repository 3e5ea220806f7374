"""Speculative decoding with the model's own multi-token-prediction (MTP) layer
(``speculative_config={"method": "mtp", ...}``): DeepSeek-V3's and GLM-4.5's checkpoints
carry one after their decoder layers (``num_nextn_predict_layers``), which HF transformers
does not load. Tiny random models here get one of random weights.

Every guess the engine makes is checked against a reference built from HF's own modules:
HF's target gives the final hidden states, and the MTP layer is HF's decoder layer at index
``num_hidden_layers`` (HF loads it when told the model has one layer more), between the
module's norms and projection written out in torch. And the output is the target's: greedy
tokens equal HF's with one and two guesses a step, under chunked prefill, preemption and two
tensor-parallel ranks, and seeded samples equal plain decoding."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from helpers.multi_token_prediction import CONFIGS, predictable_copy, with_mtp_layer
from helpers.parity import hf_greedy
from helpers.tiny_family import GREEDY, check_chunked_prefix_hits_and_two_ranks, prompts, token_ids
from helpers.tiny_models import random_hf_model
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.model_config import ModelConfig, next_token_layer_config


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    return {
        name: with_mtp_layer(random_hf_model(config, root / f"{name}_base"), root / name)
        for name, config in CONFIGS.items()
    }


@pytest.fixture(scope="module")
def hf_references(model_dirs) -> dict[str, list[list[int]]]:
    return {name: hf_greedy(path, prompts()) for name, path in model_dirs.items()}


def mtp(num_speculative_tokens: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}


class HfNextTokenReference:
    """The MTP layer's guesses from HF's modules: ``guesses(tokens, count)`` for a sequence
    whose last token was just sampled."""

    def __init__(self, model_dir: Path) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.num_layers = config["num_hidden_layers"]
        self.target = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        )
        # One layer more: HF loads the checkpoint's MTP decoder layer as its last one (a
        # sparse one where the config lists the layers' kinds).
        kinds = config.get("mlp_layer_types")
        extended = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir,
            dtype=torch.float32,
            num_hidden_layers=self.num_layers + 1,
            attn_implementation="eager",
            **({} if kinds is None else {"mlp_layer_types": [*kinds, "sparse"]}),
        )
        self.layer = extended.model.layers[self.num_layers]
        self.rotary = extended.model.rotary_emb
        self.eps = config.get("rms_norm_eps", 1e-6)
        tensors = load_file(model_dir / "model.safetensors")
        prefix = f"model.layers.{self.num_layers}."
        self.own = {
            name.removeprefix(prefix): tensor
            for name, tensor in tensors.items()
            if name.startswith(prefix)
        }
        self.embedding = self.own.get("embed_tokens.weight", tensors["model.embed_tokens.weight"])
        self.head = self.own.get(
            "shared_head.head.weight",
            tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]),
        )

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.own[f"{name}.weight"]

    def _layer(self, next_tokens: list[int], previous: torch.Tensor) -> torch.Tensor:
        """The MTP layer over positions 0.. (``next_tokens[i]`` and ``previous[i]`` at
        position i) -> its output at each."""
        length = len(next_tokens)
        embedded = self.embedding[torch.tensor(next_tokens)].clone()
        embedded[0] = 0  # position 0's embedding is zero
        x = torch.cat([self._norm(embedded, "enorm"), self._norm(previous, "hnorm")], -1)
        x = (x @ self.own["eh_proj.weight"].T)[None]
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)
        output = self.layer(
            x,
            attention_mask=mask[None, None],
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
        )
        output = output[0] if isinstance(output, tuple) else output
        return output[0]

    def _guess(self, output_row: torch.Tensor) -> int:
        logits = self._norm(output_row, "shared_head.norm") @ self.head.T
        return int(logits.argmax())

    @torch.no_grad()
    def guesses(self, tokens: list[int], count: int) -> list[int]:
        end = len(tokens) - 1  # the position of the token just sampled
        hidden = self.target.model(torch.tensor([tokens[:end]])).last_hidden_state[0]
        next_tokens = tokens[1 : end + 1]
        previous = hidden
        made: list[int] = []
        for _ in range(count):
            output = self._layer(next_tokens, previous)
            made.append(self._guess(output[-1]))
            next_tokens = [*next_tokens, made[-1]]
            previous = torch.cat([previous, output[-1:]])
        return made


def record_guesses(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Each guess list the in-process engine's drafter makes, with its sequence's tokens
    then (the last one just sampled)."""
    drafter = llm.worker.runner.draft_model
    made: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(rows, hidden):
        drafts = propose(rows, hidden)
        for row in rows:
            if row.request_id in drafts:
                made.append((list(row.token_ids[: row.end + 1]), drafts[row.request_id]))
        return drafts

    drafter.propose = recording
    return made


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("num_guesses", [1, 2])
def test_every_guess_is_the_hf_reference_s_and_the_tokens_hf_s(
    model_dirs, hf_references, name, num_guesses
):
    llm = LLM(model_dirs[name], num_blocks=256, speculative_config=mtp(num_guesses))
    made = record_guesses(llm)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references[name]
    reference = HfNextTokenReference(model_dirs[name])
    assert len(made) > 20
    for tokens, guesses in random.Random(0).sample(made, 12):
        assert guesses == reference.guesses(tokens, len(guesses)), (len(tokens), guesses)
    assert {len(guesses) for _, guesses in made} == {num_guesses}
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_layer_that_predicts_well_gets_its_guesses_accepted(model_dirs, tmp_path, name):
    """``predictable_copy``: three guesses a step, all right."""
    copy = predictable_copy(model_dirs[name], tmp_path / "copy")
    plain = LLM(copy, num_blocks=256)
    want = token_ids(plain.generate(prompts(), GREEDY))
    llm = LLM(copy, num_blocks=256, speculative_config=mtp(3))
    assert token_ids(llm.generate(prompts(), GREEDY)) == want
    stats = llm.stats()
    # Every guess is right but where a one-token prompt's first comes from position 0,
    # whose embedding the layer zeroes.
    assert stats["num_draft_tokens"] > 100
    assert stats["num_draft_tokens"] - stats["num_accepted_tokens"] <= len(prompts())


SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


def test_seeded_samples_equal_plain_decoding(model_dirs):
    plain = LLM(model_dirs["deepseek_v3"], num_blocks=256)
    llm = LLM(model_dirs["deepseek_v3"], num_blocks=256, speculative_config=mtp(2))
    want = token_ids(plain.generate(prompts(), SAMPLED))
    assert token_ids(llm.generate(prompts(), SAMPLED)) == want


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_chunked_prefill_and_preemption_keep_the_tokens(model_dirs, hf_references, preemption_mode):
    llm = LLM(
        model_dirs["glm4_moe"],
        num_blocks=24,
        max_num_batched_tokens=40,
        preemption_mode=preemption_mode,
        swap_space_bytes=64 << 20,
        speculative_config=mtp(2),
    )
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references["glm4_moe"]
    assert llm.stats()[f"num_{preemption_mode}_preemptions"] > 0


def test_a_checkpoint_without_its_own_tables_drafts_with_the_target_s(model_dirs, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(model_dirs["deepseek_v3"], base)
    tensors = load_file(base / "model.safetensors")
    layer = ModelConfig.from_dir(base).num_layers
    for name in ("embed_tokens.weight", "shared_head.head.weight"):
        del tensors[f"model.layers.{layer}.{name}"]
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(base, num_blocks=256, speculative_config=mtp(1))
    made = record_guesses(llm)
    llm.generate(prompts()[:3], GREEDY)
    reference = HfNextTokenReference(base)
    for tokens, guesses in made[::5]:
        assert guesses == reference.guesses(tokens, 1)


@pytest.mark.slow
def test_chunked_prefix_hits_and_two_ranks_match_hf(model_dirs, hf_references):
    check_chunked_prefix_hits_and_two_ranks(
        model_dirs["deepseek_v3"], hf_references["deepseek_v3"], speculative_config=mtp(2)
    )


def test_the_layer_s_experts_and_cache(model_dirs):
    config = ModelConfig.from_dir(model_dirs["deepseek_v3"])
    layer = next_token_layer_config(config)
    assert (layer.num_layers, layer.head_size, layer.num_kv_heads) == (1, 64, 1)
    assert layer.layer_experts == (config.layer_experts[-1],)
    llm = LLM(model_dirs["deepseek_v3"], num_blocks=64, speculative_config=mtp(1))
    worker = llm.worker
    assert worker.bytes_per_block == worker.kv_cache_spec.bytes_per_block * 4 // 3
    # The checkpoint's embedding copy equals the target's: read from the target, not kept;
    # its head differs (with_mtp_layer's noise): kept.
    predictor = worker.next_token_predictor
    assert predictor.embed_tokens is None and predictor.head is not None
    assert "embed_tokens.weight" not in dict(predictor.named_parameters())


def test_models_without_the_layer_are_refused_naming_why(model_dirs, tiny_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="LlamaForCausalLM has none of"):
        LLM(tiny_model_dirs["llama"], num_blocks=64, speculative_config=mtp(1))
    config = json.loads((model_dirs["glm4_moe"] / "config.json").read_text())
    shutil.copytree(model_dirs["glm4_moe"], tmp_path / "none")
    (tmp_path / "none" / "config.json").write_text(
        json.dumps({**config, "num_nextn_predict_layers": 0})
    )
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        LLM(tmp_path / "none", num_blocks=64, speculative_config=mtp(1))
    shutil.copytree(model_dirs["glm4_moe"], tmp_path / "absent")
    tensors = load_file(tmp_path / "absent" / "model.safetensors")
    layer = config["num_hidden_layers"]
    save_file(
        {n: t for n, t in tensors.items() if not n.startswith(f"model.layers.{layer}.")},
        tmp_path / "absent" / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match=rf"model.layers.{layer}.eh_proj.weight is absent"):
        LLM(tmp_path / "absent", num_blocks=64, speculative_config=mtp(1))
    with pytest.raises(ValueError, match="method 'mtp' drafts with the target's own"):
        LLM(model_dirs["glm4_moe"], speculative_config={**mtp(1), "model": "x"})
    with pytest.raises(ValueError, match="prompt_lookup_max apply to method 'ngram'"):
        LLM(model_dirs["glm4_moe"], speculative_config={**mtp(1), "prompt_lookup_max": 3})
