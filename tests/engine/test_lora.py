"""Multi-LoRA serving: greedy tokens under PEFT LoRA adapters equal HF transformers + peft.

Each adapter is made here with ``peft`` (an independent reference for LoRA) on a tiny
random model and saved as ``save_pretrained`` writes it. PEFT starts ``lora_B`` at zero,
which makes an adapter change nothing (a test of it could not fail), so both ``lora_A``
and ``lora_B`` are redrawn wide enough that the greedy tokens differ from the base
model's; every test that compares with a reference also checks that they do.
The reference is ``PeftModel.from_pretrained(base, adapter)`` generating greedily in
float32, one prompt at a time (no padding effects), EOS off.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import peft
import pytest
import torch
import transformers

from helpers.dequantized_models import save_dequantized
from helpers.family_configs import (
    COHERE_CONFIGS,
    GEMMA_CONFIGS,
    GLM4,
    GPT_OSS,
    GRANITE_MOE,
    MOE_CONFIGS,
    OLMO2,
    STARCODER2,
)
from helpers.lora_adapters import (
    ALL_MODULES,
    GREEDY,
    assert_adapter_changes_every_prompt,
    check_adapter_matches_hf_peft,
    make_lora_adapter,
    peft_greedy,
)
from helpers.tiny_models import random_hf_model
from helpers.tiny_tokenizers import BYTE_LEVEL_SPECIALS, byte_level_tokenizer, save_for_transformers
from pagedserve.frontend import LLM, LoRARequest, SamplingParams
from pagedserve.gpu_worker.layers.gathered_prefill import PREFILL_ATTENTION_ENV

PROMPT_LENGTHS = [1, 5, 16, 17, 31, 64, 100, 150]
# Adapter name -> its PEFT config. lora_alpha differs from r so that a wrong scale shows;
# with rsLoRA the scale is alpha / sqrt(r) = 4, not alpha / r = 2.
ADAPTERS = {
    "all_r8": dict(target_modules=ALL_MODULES, r=8, lora_alpha=16),
    "all_r16": dict(target_modules=ALL_MODULES, r=16, lora_alpha=8),
    "qv_rslora_r4": dict(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8, use_rslora=True),
}


def random_prompts(seed: int, lengths: Sequence[int] = PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dirs, tmp_path_factory) -> Callable[[str, str], Path]:
    """``adapter_dir(family, name)``: the adapter ``ADAPTERS[name]`` for that tiny model,
    made on first use."""
    root = tmp_path_factory.mktemp("lora_adapters")
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, name: str) -> Path:
        if (family, name) not in made:
            seed = list(ADAPTERS).index(name) + 1
            path = root / f"{family}_{name}"
            made[family, name] = make_lora_adapter(
                tiny_model_dirs[family], path, seed, **ADAPTERS[name]
            )
        return made[family, name]

    return get


@pytest.fixture(scope="module")
def reference(tiny_model_dirs, adapter_dir) -> Callable[..., list[list[int]]]:
    """``reference(family, adapter name or None, prompts)``: HF's greedy tokens, each
    prompt computed once per module."""
    cache: dict[tuple, list[int]] = {}

    def tokens(family: str, name: str | None, prompts) -> list[list[int]]:
        missing = list({tuple(p) for p in prompts if (family, name, tuple(p)) not in cache})
        if missing:
            path = None if name is None else adapter_dir(family, name)
            for prompt, output in zip(missing, peft_greedy(tiny_model_dirs[family], path, missing)):
                cache[family, name, prompt] = output
        return [cache[family, name, tuple(p)] for p in prompts]

    return tokens


def lora_modules(adapter_dir, family: str, *names: str) -> dict[str, str]:
    return {name: str(adapter_dir(family, name)) for name in names}


def request_name(request) -> str | None:
    return request.lora_name if isinstance(request, LoRARequest) else request


# Base-model prompts beside two adapters of different ranks (16, and 4 with rsLoRA),
# named by string and by LoRARequest.
MIXED_REQUESTS = [
    None,
    "all_r16",
    "qv_rslora_r4",
    None,
    LoRARequest("all_r16"),
    LoRARequest("qv_rslora_r4"),
    "all_r16",
    "qv_rslora_r4",
]


def expected_mixed(reference, family: str, prompts) -> list[list[int]]:
    return [
        reference(family, request_name(request), [prompt])[0]
        for prompt, request in zip(prompts, MIXED_REQUESTS, strict=True)
    ]


# ---------------------------------------------------------------- same tokens as peft


@pytest.mark.parametrize("name", ["all_r8", "qv_rslora_r4"])
@pytest.mark.parametrize(
    "family", ["llama", "mistral", "qwen3", pytest.param("qwen2", marks=pytest.mark.slow)]
)
def test_adapter_tokens_match_hf_peft(tiny_model_dirs, adapter_dir, reference, family, name):
    prompts = random_prompts(1, [1, 16, 31, 100])
    llm = LLM(
        tiny_model_dirs[family],
        num_blocks=256,
        lora_modules=lora_modules(adapter_dir, family, name),
    )
    expected = reference(family, name, prompts)
    assert token_ids(llm.generate(prompts, GREEDY, lora_request=name)) == expected
    assert_adapter_changes_every_prompt(expected, reference(family, None, prompts))
    # The same engine still serves the base model.
    assert token_ids(llm.generate(prompts, GREEDY)) == reference(family, None, prompts)


def test_one_batch_mixes_the_base_model_and_two_adapters(tiny_model_dirs, adapter_dir, reference):
    prompts = random_prompts(2)
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=256,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r16", "qv_rslora_r4"),
    )
    outputs = llm.generate(prompts, GREEDY, lora_request=MIXED_REQUESTS)
    expected = expected_mixed(reference, "llama", prompts)
    assert token_ids(outputs) == expected
    with_adapter = [i for i, request in enumerate(MIXED_REQUESTS) if request is not None]
    assert_adapter_changes_every_prompt(
        [expected[i] for i in with_adapter],
        reference("llama", None, [prompts[i] for i in with_adapter]),
    )


def test_chat_under_an_adapter(tiny_model_dirs, adapter_dir, reference, tmp_path):
    model_dir = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "llama_chat")
    save_for_transformers(byte_level_tokenizer([], vocab_size=512), model_dir, BYTE_LEVEL_SPECIALS)
    chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    llm = LLM(
        model_dir,
        num_blocks=64,
        chat_template=chat_template,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r8"),
    )
    messages = [{"role": "user", "content": "Tell me about paged attention."}]
    output = llm.chat(messages, GREEDY, lora_request="all_r8")[0]
    expected = reference("llama", "all_r8", [output.prompt_token_ids])
    assert [output.outputs[0].token_ids] == expected
    base = llm.chat(messages, GREEDY)[0]
    assert base.prompt_token_ids == output.prompt_token_ids
    assert [base.outputs[0].token_ids] == reference("llama", None, [base.prompt_token_ids])
    assert_adapter_changes_every_prompt(expected, [base.outputs[0].token_ids])


def test_beam_search_under_an_adapter_matches_hf_peft(tiny_model_dirs, adapter_dir):
    # Beams fork sequences (and share their blocks): every fork runs through the adapter.
    params = SamplingParams(beam_width=3, n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts(6, [8, 30])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dirs["llama"], dtype=torch.float32
    )
    model = peft.PeftModel.from_pretrained(model, adapter_dir("llama", "all_r16"))
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            input_ids = torch.tensor([prompt])
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                num_beams=params.beam_width,
                num_return_sequences=params.n,
                max_new_tokens=params.max_tokens,
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected.append(generated[:, len(prompt) :].tolist())
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=64,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r16"),
    )
    outputs = llm.generate(prompts, params, lora_request="all_r16")
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    base = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in base] != expected


# ---------------------------------------------------------------- prefix caching


def test_prefix_cache_is_shared_within_an_adapter_never_across(
    tiny_model_dirs, adapter_dir, reference
):
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=64,
        block_size=8,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r16", "qv_rslora_r4"),
    )
    prompt = random_prompts(3, [41])[0]  # 5 full blocks of 8
    names = [None, "all_r16", "qv_rslora_r4"]
    first = {name: llm.generate(prompt, GREEDY, lora_request=name)[0] for name in names}
    again = {name: llm.generate(prompt, GREEDY, lora_request=name)[0] for name in names}
    for name in names:
        expected = reference("llama", name, [prompt])[0]
        assert first[name].outputs[0].token_ids == expected, name
        assert again[name].outputs[0].token_ids == expected, name
        assert first[name].num_cached_tokens == 0, name
        assert again[name].num_cached_tokens == 40, name


def test_no_cache_namespace_reaches_an_adapters_cached_prefixes(
    tiny_model_dirs, adapter_dir, reference
):
    # Whatever namespace a caller names (an HTTP client's cache_salt is any string), the
    # base model must not read K/V computed through an adapter.
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=64,
        block_size=8,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r16"),
    )
    prompt = random_prompts(3, [41])[0]
    llm.generate(prompt, GREEDY, lora_request="all_r16")
    for namespace in ["lora:1", "\x00lora:1", "all_r16"]:
        base = llm.generate(prompt, GREEDY, cache_namespace=namespace)[0]
        assert base.num_cached_tokens == 0, repr(namespace)
        assert base.outputs[0].token_ids == reference("llama", None, [prompt])[0], repr(namespace)


def test_same_prompt_under_each_adapter_in_one_batch(tiny_model_dirs, adapter_dir, reference):
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=64,
        block_size=8,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r16", "qv_rslora_r4"),
    )
    prompt = random_prompts(4, [41])[0]
    names = [None, "all_r16", "qv_rslora_r4", "all_r16"]
    outputs = llm.generate([prompt] * len(names), GREEDY, lora_request=names)
    assert token_ids(outputs) == [reference("llama", name, [prompt])[0] for name in names]
    assert len({tuple(tokens) for tokens in token_ids(outputs)}) == 3


# ---------------------------------------------------------------- scheduling


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_each_adapters_tokens(tiny_model_dirs, adapter_dir, reference, mode):
    # 16 blocks of 16 tokens hold 256; the eight requests need 39 blocks in all.
    llm = LLM(
        tiny_model_dirs["llama"],
        block_size=16,
        num_blocks=16,
        max_num_batched_tokens=64,
        preemption_mode=mode,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r16", "qv_rslora_r4"),
    )
    prompts = random_prompts(2)
    outputs = llm.generate(prompts, GREEDY, lora_request=MIXED_REQUESTS)
    assert token_ids(outputs) == expected_mixed(reference, "llama", prompts)
    assert llm.stats()[f"num_{mode}_preemptions"] > 0


@pytest.mark.parametrize("prefill_attention", ["kernel", "sdpa"])
def test_chunked_prefill_keeps_each_adapters_tokens(
    tiny_model_dirs, adapter_dir, reference, monkeypatch, prefill_attention
):
    # 40 tokens a step: the 64-, 100- and 150-token prompts are prefilled in chunks, beside
    # other adapters' decodes; with the paged kernel and with SDPA over gathered K/V (the
    # CUDA default).
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, prefill_attention)
    llm = LLM(
        tiny_model_dirs["qwen3"],
        num_blocks=128,
        enable_chunked_prefill=True,
        max_num_batched_tokens=40,
        lora_modules=lora_modules(adapter_dir, "qwen3", "all_r16", "qv_rslora_r4"),
    )
    prompts = random_prompts(2)
    outputs = llm.generate(prompts, GREEDY, lora_request=MIXED_REQUESTS)
    assert token_ids(outputs) == expected_mixed(reference, "qwen3", prompts)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_each_adapters_tokens(
    tiny_model_dirs, adapter_dir, reference, method
):
    # Verification steps run several tokens of a request at once, each through its adapter;
    # a draft model (the base model here) guesses without adapters.
    rng = random.Random(7)
    phrases = [[rng.randrange(3, 512) for _ in range(5)] for _ in MIXED_REQUESTS]
    prompts = [[rng.randrange(3, 512) for _ in range(9)] + phrase * 3 for phrase in phrases]
    model = tiny_model_dirs["llama"]
    speculative = (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": str(model), "num_speculative_tokens": 4}
    )
    llm = LLM(
        model,
        num_blocks=256,
        speculative_config=speculative,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r16", "qv_rslora_r4"),
    )
    outputs = llm.generate(prompts, GREEDY, lora_request=MIXED_REQUESTS)
    assert token_ids(outputs) == expected_mixed(reference, "llama", prompts)
    assert llm.stats()["num_accepted_tokens"] > 0, llm.stats()


def test_max_loras_runs_one_adapter_per_step_with_the_same_tokens(
    tiny_model_dirs, adapter_dir, reference
):
    prompts = random_prompts(2)
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=256,
        max_loras=1,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r16", "qv_rslora_r4"),
    )
    scheduler = llm.engine.scheduler
    schedule, batches = scheduler.schedule, []

    def recording_schedule():
        plan = schedule()
        batches.append({request.lora_id for request in scheduler.running if request.lora_id})
        return plan

    scheduler.schedule = recording_schedule
    outputs = llm.generate(prompts, GREEDY, lora_request=MIXED_REQUESTS)
    assert token_ids(outputs) == expected_mixed(reference, "llama", prompts)
    assert max(len(adapters) for adapters in batches) == 1
    assert set().union(*batches) == {1, 2}


def test_multiprocess_equals_in_process(tiny_model_dirs, adapter_dir, reference):
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=64,
        multiprocess=True,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r16", "qv_rslora_r4"),
    )
    try:
        prompts = random_prompts(2)
        outputs = llm.generate(prompts, GREEDY, lora_request=MIXED_REQUESTS)
        assert token_ids(outputs) == expected_mixed(reference, "llama", prompts)
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- refusals


def test_adapters_on_int8_weights_match_hf_peft_on_the_dequantized_model(
    tiny_model_dirs, adapter_dir, tmp_path
):
    """The adapters' products add to the quantized base layer's output; the reference is
    HF + peft over the base model with its decoder weights dequantized."""
    dequantized = save_dequantized(tiny_model_dirs["llama"], tmp_path / "dequantized")
    prompts = random_prompts(7, [5, 31, 100])
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=128,
        quantization="int8",
        lora_modules=lora_modules(adapter_dir, "llama", "all_r8"),
    )
    got = token_ids(llm.generate(prompts, GREEDY, lora_request="all_r8"))
    assert got == peft_greedy(dequantized, adapter_dir("llama", "all_r8"), prompts)
    assert_adapter_changes_every_prompt(got, token_ids(llm.generate(prompts, GREEDY)))


def test_unknown_adapter_name_is_refused_listing_the_known_ones(tiny_model_dirs, adapter_dir):
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=16,
        lora_modules=lora_modules(adapter_dir, "llama", "all_r16", "qv_rslora_r4"),
    )
    for request in ["nope", LoRARequest("nope"), [None, "nope"]]:
        prompts = [[1, 2, 3]] * (len(request) if isinstance(request, list) else 1)
        with pytest.raises(ValueError, match=r"lora_request.*'nope'") as error:
            llm.generate(prompts, GREEDY, lora_request=request)
        assert "all_r16" in str(error.value) and "qv_rslora_r4" in str(error.value)
    without_adapters = LLM(tiny_model_dirs["llama"], num_blocks=16)
    with pytest.raises(ValueError, match=r"lora_request.*'all_r16'"):
        without_adapters.generate([[1, 2, 3]], GREEDY, lora_request="all_r16")


def edit_config(path: Path, **changes) -> Path:
    config_file = path / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))
    return path


def peft_adapter(tiny_model_dirs, path: Path, family: str = "llama", **config) -> Path:
    config.setdefault("r", 4)
    config.setdefault("lora_alpha", 8)
    return make_lora_adapter(tiny_model_dirs[family], path, seed=0, **config)


def _without_weights(path: Path) -> Path:
    (path / "adapter_model.safetensors").unlink()
    return path


def _weights_linked_outside(path: Path) -> Path:
    """The weights moved out of the directory, a link to them left in their place: they
    would pass every other check, so only the link is refused."""
    weights = path / "adapter_model.safetensors"
    weights.symlink_to(weights.rename(path.parent / f"{path.name}.safetensors"))
    return path


BAD_ADAPTERS: dict[str, tuple[Callable[[dict, Path], Path], str]] = {
    # case: (make the bad adapter in a folder, what the refusal must name)
    "lm_head": (
        lambda dirs, p: peft_adapter(dirs, p, target_modules=["q_proj", "lm_head"]),
        "lm_head",
    ),
    "embed_tokens": (
        lambda dirs, p: peft_adapter(dirs, p, target_modules=["embed_tokens", "v_proj"]),
        "embed_tokens",
    ),
    "bias": (
        lambda dirs, p: edit_config(peft_adapter(dirs, p, target_modules=["q_proj"]), bias="all"),
        "bias='all'",
    ),
    "fan_in_fan_out": (
        lambda dirs, p: edit_config(
            peft_adapter(dirs, p, target_modules=["q_proj"]), fan_in_fan_out=True
        ),
        "fan_in_fan_out=True",
    ),
    "modules_to_save": (
        lambda dirs, p: peft_adapter(
            dirs, p, target_modules=["q_proj"], modules_to_save=["lm_head"]
        ),
        "modules_to_save",
    ),
    "no_directory": (lambda dirs, p: p / "absent", "adapter_config.json"),
    "no_weights": (
        lambda dirs, p: _without_weights(peft_adapter(dirs, p, target_modules=["q_proj"])),
        "adapter_model.safetensors",
    ),
    "weights_linked_outside": (
        lambda dirs, p: _weights_linked_outside(peft_adapter(dirs, p, target_modules=["q_proj"])),
        "adapter_model.safetensors is a link to a file outside the adapter directory",
    ),
    # Made for Qwen3, whose q_proj has 256 outputs; the Llama's has 128.
    "shape": (
        lambda dirs, p: peft_adapter(dirs, p, family="qwen3", target_modules=["q_proj", "v_proj"]),
        r"q_proj.*\(256, 4\).*do not fit",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_bad_adapter_is_refused_at_start_naming_it_and_the_problem(
    tiny_model_dirs, adapter_dir, tmp_path, case
):
    make, problem = BAD_ADAPTERS[case]
    bad = make(tiny_model_dirs, tmp_path / case)
    modules = {**lora_modules(adapter_dir, "llama", "all_r8"), "bad": str(bad)}
    with pytest.raises(ValueError, match=rf"(?s)'bad'.*{problem}"):
        LLM(tiny_model_dirs["llama"], num_blocks=16, lora_modules=modules)


def test_adapters_are_refused_with_tensor_parallelism_cuda_graphs_or_other_models(
    tiny_model_dirs, adapter_dir, tmp_path
):
    modules = lora_modules(adapter_dir, "llama", "all_r8")
    with pytest.raises(ValueError, match=r"lora_modules.*tensor_parallel_size"):
        LLM(tiny_model_dirs["llama"], num_blocks=16, tensor_parallel_size=2, lora_modules=modules)
    # device="cuda" so that the refusal is the adapters', not cuda_graphs' need of a GPU.
    with pytest.raises(ValueError, match=r"lora_modules.*cuda_graphs"):
        LLM(
            tiny_model_dirs["llama"],
            num_blocks=16,
            device="cuda",
            cuda_graphs=True,
            lora_modules=modules,
        )
    opt_adapter = peft_adapter(tiny_model_dirs, tmp_path / "opt", "opt", target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"lora_modules.*OPTForCausalLM"):
        LLM(tiny_model_dirs["opt"], num_blocks=16, lora_modules={"opt": str(opt_adapter)})


# ---------------------------------------------------------------- adapters at run time


def held_adapter_ids(llm: LLM) -> set[int]:
    """The adapter ids the in-process worker's layers hold products for."""
    return {
        adapter_id
        for module in llm.worker.model.modules()
        if getattr(module, "lora", None) is not None
        for adapter_id, products in module.lora.products.items()
        if products
    }


@pytest.mark.parametrize("multiprocess", [False, True])
def test_adapters_load_and_unload_at_run_time(
    tiny_model_dirs, adapter_dir, reference, multiprocess
):
    prompts = random_prompts(5, [3, 17, 40])
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, enable_lora=True, multiprocess=multiprocess)
    base = reference("llama", None, prompts)
    assert token_ids(llm.generate(prompts, GREEDY)) == base
    assert llm.load_lora("first", adapter_dir("llama", "all_r8")) == 1
    assert llm.load_lora("second", adapter_dir("llama", "qv_rslora_r4")) == 2
    first, second = (
        reference("llama", "all_r8", prompts),
        reference("llama", "qv_rslora_r4", prompts),
    )
    assert_adapter_changes_every_prompt(first, base)
    mixed = llm.generate(
        prompts * 3, GREEDY, lora_request=["first"] * 3 + ["second"] * 3 + [None] * 3
    )
    assert token_ids(mixed) == first + second + base
    llm.unload_lora("first")
    with pytest.raises(ValueError, match=r"lora_request: no LoRA adapter named 'first'.*second"):
        llm.generate(prompts, GREEDY, lora_request="first")
    assert token_ids(llm.generate(prompts, GREEDY, lora_request="second")) == second
    # The same directory again, under a new name: a new id, so none of the prefixes the
    # first one cached can serve it (they would be equal here; the id is what is checked).
    assert llm.load_lora("again", adapter_dir("llama", "all_r8")) == 3
    assert token_ids(llm.generate(prompts, GREEDY, lora_request="again")) == first
    assert llm.lora_ids == {"second": 2, "again": 3}
    if not multiprocess:
        assert held_adapter_ids(llm) == {2, 3}  # the first one's products are gone
    llm.shutdown()


def test_an_adapter_unloaded_mid_request_serves_it_to_the_end(
    tiny_model_dirs, adapter_dir, reference
):
    prompt = random_prompts(6, [20])[0]
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, enable_lora=True)
    lora_id = llm.load_lora("r8", adapter_dir("llama", "all_r8"))
    llm.engine.add_request("r", prompt, GREEDY, frozenset(), lora_id=lora_id)
    tokens = []
    for _ in range(3):
        tokens += [t for d in llm.engine.step() for t in d.new_token_ids]
    llm.unload_lora("r8")
    assert held_adapter_ids(llm) == {lora_id}
    while llm.engine.has_unfinished_requests():
        tokens += [t for d in llm.engine.step() for t in d.new_token_ids]
    assert tokens == reference("llama", "all_r8", [prompt])[0]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # a step after its end
    assert held_adapter_ids(llm) == set()


@pytest.mark.parametrize(
    "case", ["shape", "no_weights", "lm_head", "no_directory", "weights_linked_outside"]
)
def test_a_bad_adapter_is_refused_at_run_time_and_nothing_changes(
    tiny_model_dirs, adapter_dir, reference, tmp_path, case
):
    make, problem = BAD_ADAPTERS[case]
    llm = LLM(tiny_model_dirs["llama"], num_blocks=32, enable_lora=True)
    with pytest.raises(ValueError, match=rf"(?s)'bad'.*{problem}"):
        llm.load_lora("bad", make(tiny_model_dirs, tmp_path / case))
    assert llm.lora_ids == {}
    prompts = random_prompts(7, [9])
    assert token_ids(llm.generate(prompts, GREEDY)) == reference("llama", None, prompts)


def test_an_adapter_in_a_linked_directory_loads_at_run_time(
    tiny_model_dirs, adapter_dir, reference, tmp_path
):
    # The directory a link (a deployment's "current"), its files inside what it points at.
    linked = tmp_path / "current"
    linked.symlink_to(adapter_dir("llama", "all_r8"), target_is_directory=True)
    llm = LLM(tiny_model_dirs["llama"], num_blocks=32, enable_lora=True)
    assert llm.load_lora("linked", linked) == 1
    prompts = random_prompts(7, [9])
    tokens = token_ids(llm.generate(prompts, GREEDY, lora_request="linked"))
    assert tokens == reference("llama", "all_r8", prompts)


def test_run_time_loading_is_refused_where_it_cannot_be_done(tiny_model_dirs, adapter_dir):
    path = adapter_dir("llama", "all_r8")
    fixed = LLM(tiny_model_dirs["llama"], num_blocks=16)
    with pytest.raises(ValueError, match=r"'r8': this engine serves no LoRA adapters.*enable_lora"):
        fixed.load_lora("r8", path)
    llm = LLM(tiny_model_dirs["llama"], num_blocks=16, enable_lora=True)
    llm.load_lora("r8", path)
    with pytest.raises(ValueError, match=r"lora_name: an adapter named 'r8' is already loaded"):
        llm.load_lora("r8", path)
    with pytest.raises(ValueError, match=r"lora_name: adapter names must be non-empty"):
        llm.load_lora("", path)
    with pytest.raises(ValueError, match=r"lora_name: no LoRA adapter named 'other' here.*'r8'"):
        llm.unload_lora("other")
    with pytest.raises(ValueError, match=r"lora_modules.*OPTForCausalLM"):
        LLM(tiny_model_dirs["opt"], num_blocks=16, enable_lora=True)
    with pytest.raises(TypeError, match="enable_lora must be a bool"):
        LLM(tiny_model_dirs["llama"], num_blocks=16, enable_lora="yes")


def test_a_lora_request_with_a_path_loads_its_adapter_as_vllm_offline_does(
    tiny_model_dirs, adapter_dir, reference
):
    prompts = random_prompts(8, [4, 30])
    path = str(adapter_dir("llama", "all_r16"))
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, enable_lora=True)
    request = LoRARequest("r16", 1, path)
    want = reference("llama", "all_r16", prompts)
    assert token_ids(llm.generate(prompts, GREEDY, lora_request=request)) == want
    assert token_ids(llm.generate(prompts, GREEDY, lora_request=request)) == want
    assert llm.lora_ids == {"r16": 1}
    with pytest.raises(ValueError, match=r"adapter 'r16' has id 1 here, not 2"):
        llm.generate(prompts, GREEDY, lora_request=LoRARequest("r16", 2, path))
    other = str(adapter_dir("llama", "all_r8"))
    with pytest.raises(ValueError, match=r"adapter 'r16' was loaded from .*, not .*all_r8"):
        llm.generate(prompts, GREEDY, lora_request=LoRARequest("r16", 1, other))
    fixed = LLM(tiny_model_dirs["llama"], num_blocks=16)
    with pytest.raises(ValueError, match=r"lora_request: no LoRA adapter named 'r16'"):
        fixed.generate(prompts, GREEDY, lora_request=request)


# ---------------------------------------------------------------- Gemma and mixture-of-experts


@pytest.fixture(scope="module")
def more_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny Gemma 2 / Gemma 3 (test_gemma.py's: sliding and global layers, soft-caps) and
    the mixture-of-experts models of test_moe.py (Qwen2-MoE with a dense layer)."""
    root = tmp_path_factory.mktemp("lora_more_models")
    configs = {**{f: GEMMA_CONFIGS[f] for f in ("gemma", "gemma2", "gemma3")}, **MOE_CONFIGS}
    return {family: random_hf_model(config, root / family) for family, config in configs.items()}


@pytest.mark.parametrize(
    ("family", "targets"),
    [
        ("gemma", ALL_MODULES),
        ("gemma2", ALL_MODULES),
        ("gemma3", ALL_MODULES),
        # Attention only: PEFT would put gate/up/down on every expert too.
        ("mixtral", ["q_proj", "k_proj", "v_proj", "o_proj"]),
        ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ],
)
def test_gemma_and_moe_adapters_match_hf_peft(more_model_dirs, tmp_path, family, targets):
    check_adapter_matches_hf_peft(more_model_dirs[family], tmp_path, targets, seed=5, prompt_seed=3)


def test_a_moe_adapter_reaches_the_dense_layers_mlp_but_never_an_expert(more_model_dirs, tmp_path):
    # Qwen2-MoE's layer 1 is dense (mlp_only_layers): an adapter on its MLP is served. PEFT
    # targets every gate_proj it finds, the experts' and the shared expert's too: refused by
    # name, before anything loads.
    model_dir = more_model_dirs["qwen2_moe"]
    prompts = random_prompts(4, [1, 17, 40])
    dense = make_lora_adapter(
        model_dir,
        tmp_path / "dense",
        seed=6,
        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
        layers_to_transform=[1],
        r=8,
        lora_alpha=16,
    )
    llm = LLM(model_dir, num_blocks=128, lora_modules={"dense": str(dense)})
    assert token_ids(llm.generate(prompts, GREEDY, lora_request="dense")) == peft_greedy(
        model_dir, dense, prompts
    )
    experts = make_lora_adapter(
        model_dir, tmp_path / "experts", seed=7, target_modules=["gate_proj"], r=4, lora_alpha=8
    )
    refusal = r"lora_modules\['experts'\].*mlp\.(experts\.\d+|shared_expert)\.gate_proj of mix"
    with pytest.raises(ValueError, match=refusal):
        LLM(model_dir, num_blocks=128, lora_modules={"experts": str(experts)})


# ---------------------------------------------------------------- the other families

_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# (config, the projections its HF model has). Cohere's and GLM-4's query and key rows are
# reordered on loading: so are the adapters' B rows on them. GLM-4 fuses gate/up as PEFT
# sees it; StarCoder2's MLP is c_fc / c_proj; gpt-oss's experts are out of reach (every
# layer's MLP is a mixture of experts).
_MORE_FAMILIES = {
    "olmo2": (OLMO2, ALL_MODULES),
    "cohere2": (COHERE_CONFIGS["cohere2"], ALL_MODULES),
    "glm4": (GLM4, [*_ATTENTION, "gate_up_proj", "down_proj"]),
    "starcoder2": (STARCODER2, [*_ATTENTION, "c_fc", "c_proj"]),
    "gpt_oss": (GPT_OSS, _ATTENTION),
    "granite_moe": (GRANITE_MOE, _ATTENTION),
}


@pytest.mark.parametrize("family", list(_MORE_FAMILIES))
def test_adapters_on_more_families_match_hf_peft(family, tmp_path):
    config, targets = _MORE_FAMILIES[family]
    model_dir = random_hf_model(config, tmp_path / family)
    check_adapter_matches_hf_peft(model_dir, tmp_path, targets, seed=9, prompt_seed=8)
    if family == "glm4":  # Llama's separate gate/up: not GLM-4's projections, refused so
        separate = make_lora_adapter(
            model_dir, tmp_path / "separate", seed=9, target_modules=["o_proj"], r=4
        )
        weights = separate / "adapter_model.safetensors"
        from safetensors.torch import load_file, save_file

        tensors = {
            name.replace("self_attn.o_proj", "mlp.gate_proj"): tensor
            for name, tensor in load_file(weights).items()
        }
        save_file(tensors, weights)
        with pytest.raises(ValueError, match="targets 'gate_proj', which Glm4ForCausalLM"):
            LLM(model_dir, num_blocks=128, lora_modules={"s": str(separate)})
