"""The offline API's pooling calls (``LLM.embed``, ``classify``, ``encode``, ``score``): a
part of ``LLM`` kept apart from generation. They run prompt-only requests through the
engine as ``generate`` runs its requests (``LLM._run``), and shape the pooled vectors."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedserve.frontend.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    most_probable_label,
)
from pagedserve.frontend.prompts import PromptType, as_prompt_list
from pagedserve.frontend.scores import (
    ScoringOutput,
    ScoringRequestOutput,
    check_cross_encoder,
    cosine_similarity,
    pair_indices,
)
from pagedserve.scheduler.pooling_params import (
    POOLING_TASKS,
    PoolingParams,
    split_rows,
)

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LoRARef


class PoolingCalls:
    """``LLM``'s calls that pool prompts instead of generating (a mixin: the engine, the
    tokenizer and the model config are ``LLM``'s)."""

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARef | Sequence[LoRARef] = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (text or token ids) as one continuously batched run, as
        vLLM's embed task does: each request computes its prompt only (chunked, with
        cached prefixes, beside generation requests) and returns the final-norm hidden
        state of its last token (or the mean over its tokens, or its first, as the model's
        pooler config says: ``pooler_config.py``), L2-normalized unless
        ``PoolingParams(normalize=False)``
        (``dimensions``: the first that many values, then normalized). One
        ``EmbeddingRequestOutput`` per prompt, in order: ``.outputs.embedding``."""
        prompt_list = as_prompt_list(prompts)
        if pooling_params is None:
            pooling_params = self.embedding_params()
        params_list = self._model_pooling(
            self._as_pooling_params_list(pooling_params, len(prompt_list))
        )
        return self._pool("embed", prompt_list, params_list, lora_request, priority, use_tqdm)

    def _model_pooling(self, params_list: list[PoolingParams]) -> list[PoolingParams]:
        """Each request's ``dimensions`` checked against the model, and an embedding's
        pooling type made the model's, whatever the caller's says."""
        checked = []
        for params in params_list:
            params.check_dimensions(self.model_config.embedding_size, "pooling_params.dimensions")
            if params.task == "embed":
                params = dataclasses.replace(params, pooling_type=self.pooler_config.pooling_type)
            checked.append(params)
        return checked

    def embedding_params(
        self, normalize: bool | None = None, dimensions: int | None = None
    ) -> PoolingParams:
        """An embedding request's ``PoolingParams`` on this model: its pooling type, and
        ``normalize`` unless given as its pooler config says (sentence-transformers'
        Normalize module; normalized without one)."""
        return PoolingParams(
            normalize=self.pooler_config.normalize if normalize is None else normalize,
            dimensions=dimensions,
            pooling_type=self.pooler_config.pooling_type,
        )

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARef | Sequence[LoRARef] = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Classify every prompt (text or token ids) with a sequence classification model
        (HF's ``*ForSequenceClassification``), as vLLM's classify task does: each request
        computes its prompt only and its last token's final hidden state goes through the
        classifier head, then a softmax over the labels (a sigmoid for a one-label model;
        ``PoolingParams(task="classify", use_activation=False)``: the raw logits). One
        ``ClassificationRequestOutput`` per prompt, in order: ``.outputs.probs`` (the
        model's label order) and ``.label`` (the most probable)."""
        prompt_list = as_prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams(task="classify")
        params_list = self._as_pooling_params_list(pooling_params, len(prompt_list))
        pooled = self._pool("classify", prompt_list, params_list, lora_request, priority, use_tqdm)
        return [self._classification(output) for output in pooled]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARef | Sequence[LoRARef] = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's ``encode``: any pooling task of the model, ``pooling_task`` one of
        "embed" and "token_embed" (a causal LM), "classify" and "token_classify" (a
        sequence classification model); None: ``pooling_params.task``, else the model's
        one-vector task. "embed" and "classify" give ``embed``'s and ``classify``'s vectors;
        the token tasks give a row per prompt token (each normalized, or through the
        classifier head and its activation), from every chunk of the prompt, without
        prefix-cache hits. One ``PoolingRequestOutput`` per prompt, in order:
        ``.outputs.data``."""
        prompt_list = as_prompt_list(prompts)
        if pooling_task is None:
            if isinstance(pooling_params, PoolingParams):
                pooling_task = pooling_params.task
            else:
                pooling_task = "classify" if self.model_config.task == "classify" else "embed"
        if pooling_task not in POOLING_TASKS:
            raise ValueError(
                f"pooling_task must be one of {', '.join(map(repr, POOLING_TASKS))}, got "
                f"{pooling_task!r}"
            )
        if pooling_params is None:
            if pooling_task.removeprefix("token_") == "embed":
                pooling_params = self.embedding_params()
            else:
                pooling_params = PoolingParams(task="classify")
            pooling_params = dataclasses.replace(pooling_params, task=pooling_task)
        params_list = self._as_pooling_params_list(pooling_params, len(prompt_list))
        for params in params_list:
            if params.task != pooling_task:
                raise ValueError(
                    f"pooling_params.task={params.task!r} with pooling_task={pooling_task!r}: "
                    "give one task"
                )
        params_list = self._model_pooling(params_list)
        pooled = self._pool(
            pooling_task, prompt_list, params_list, lora_request, priority, use_tqdm
        )
        return [_pooling_output(output, pooling_task) for output in pooled]

    def _classification(self, output: EmbeddingRequestOutput) -> ClassificationRequestOutput:
        probs = output.outputs.embedding
        return ClassificationRequestOutput(
            request_id=output.request_id,
            prompt=output.prompt,
            prompt_token_ids=output.prompt_token_ids,
            outputs=ClassificationOutput(probs),
            label=most_probable_label(self.model_config.labels, probs),
            num_cached_tokens=output.num_cached_tokens,
        )

    def _pool(
        self,
        task: str,
        prompt_list: list[PromptType],
        params_list: list[PoolingParams],
        lora_request: LoRARef | Sequence[LoRARef],
        priority: int | Sequence[int] | None,
        use_tqdm: bool,
    ) -> list[EmbeddingRequestOutput]:
        """Run one pooling request of ``task`` per prompt (``embed``'s, ``classify``'s and
        ``encode``'s); the pooled vectors in order."""
        for params in params_list:
            if params.task != task:
                raise ValueError(
                    f"pooling_params.task={params.task!r}: {task}() takes "
                    f"PoolingParams(task={task!r})"
                )
            self.check_task(params)
        lora_ids = self.lora_ids_of(lora_request, len(prompt_list))
        priorities = self.priorities_of(priority, len(prompt_list))
        encoded = [
            self.encode_prompt(prompt, f"prompts[{index}]")
            for index, prompt in enumerate(prompt_list)
        ]
        for index, token_ids in enumerate(encoded):
            try:
                self.engine.check_request_fits(len(token_ids), 0)
            except ValueError as error:
                raise ValueError(f"prompts[{index}]: {error}") from None
        return self._run(prompt_list, encoded, params_list, None, lora_ids, priorities, use_tqdm)

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARef = None,
        priority: int = 0,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """vLLM's score. An embedding model: the cosine similarity of each pair's
        embeddings (``embed``'s), each distinct prompt embedded once. A cross-encoder (a
        classification model with one label): each pair's texts joined as the tokenizer
        joins a pair, classified, its sigmoid the score. One ``data_1`` is scored against
        every ``data_2``, or as many of each pairwise. ``truncate_prompt_tokens``: keep
        each prompt's last k tokens (a cross-encoder's pair: k tokens, cut from the longer
        text first); -1: the context window. One ``ScoringRequestOutput`` per pair, in
        order: ``.outputs.score``."""
        prompts_1 = as_prompt_list(data_1)
        prompts_2 = as_prompt_list(data_2)
        pairs = pair_indices(len(prompts_1), len(prompts_2), ("data_1", "data_2"))
        keep = None
        if truncate_prompt_tokens is not None:
            max_model_len = self.scheduler_config.max_model_len
            keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            valid = isinstance(keep, int) and not isinstance(keep, bool)
            if not valid or not 1 <= keep <= max_model_len:
                raise ValueError(
                    f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the "
                    f"model's context window), got {truncate_prompt_tokens!r}"
                )
        if self.model_config.task == "classify":
            return self._cross_encoder_scores(
                prompts_1, prompts_2, pairs, keep, lora_request, priority, use_tqdm
            )
        prompts: list[PromptType] = [*prompts_1, *prompts_2]
        if keep is not None:
            prompts = [
                self.encode_prompt(prompt, f"data_{1 if i < len(prompts_1) else 2}")[-keep:]
                for i, prompt in enumerate(prompts)
            ]
        embeddings = self.embed(
            prompts,
            PoolingParams(normalize=True),
            lora_request=lora_request,
            priority=priority,
            use_tqdm=use_tqdm,
        )
        offset = len(prompts_1)
        outputs = []
        for i, j in pairs:
            first, second = embeddings[i], embeddings[offset + j]
            outputs.append(
                ScoringRequestOutput(
                    request_id=f"{first.request_id}+{second.request_id}",
                    outputs=ScoringOutput(
                        cosine_similarity(first.outputs.embedding, second.outputs.embedding)
                    ),
                    prompt_token_ids=first.prompt_token_ids + second.prompt_token_ids,
                )
            )
        return outputs

    def _cross_encoder_scores(
        self,
        prompts_1: list[PromptType],
        prompts_2: list[PromptType],
        pairs: list[tuple[int, int]],
        keep: int | None,
        lora_request: LoRARef,
        priority: int,
        use_tqdm: bool,
    ) -> list[ScoringRequestOutput]:
        """``score`` on a cross-encoder: one classification per pair of texts."""
        check_cross_encoder(self.model_config, "model")
        tokenizer = self._require_tokenizer("data_1")
        for name, prompt_list in (("data_1", prompts_1), ("data_2", prompts_2)):
            for index, prompt in enumerate(prompt_list):
                if not isinstance(prompt, str):
                    raise ValueError(
                        f"{name}[{index}]: a cross-encoder scores texts (the tokenizer joins "
                        f"each pair), got {type(prompt).__name__}"
                    )
        encoded = [tokenizer.encode_pair(prompts_1[i], prompts_2[j], keep) for i, j in pairs]
        classified = self.classify(
            encoded, lora_request=lora_request, priority=priority, use_tqdm=use_tqdm
        )
        return [
            ScoringRequestOutput(
                request_id=output.request_id,
                outputs=ScoringOutput(output.outputs.probs[0]),
                prompt_token_ids=output.prompt_token_ids,
            )
            for output in classified
        ]

    def _as_pooling_params_list(
        self, params: PoolingParams | Sequence[PoolingParams] | None, count: int
    ) -> list[PoolingParams]:
        if params is None:
            return [PoolingParams()] * count
        if isinstance(params, PoolingParams):
            return [params] * count
        params = list(params)
        if len(params) != count or not all(isinstance(p, PoolingParams) for p in params):
            raise ValueError(
                f"pooling_params: got {params!r} for {count} prompts; pass one PoolingParams "
                "or one each"
            )
        return params


def _pooling_output(output: EmbeddingRequestOutput, task: str) -> PoolingRequestOutput:
    """An ``encode`` result: a per-token task's values cut into a row per prompt token."""
    values = output.outputs.embedding if output.outputs is not None else []
    data: list[float] | list[list[float]] = values
    if task.startswith("token_"):
        data = split_rows(values, len(output.prompt_token_ids))
    return PoolingRequestOutput(
        request_id=output.request_id,
        prompt=output.prompt,
        prompt_token_ids=output.prompt_token_ids,
        outputs=PoolingOutput(data),
        task=task,
        num_cached_tokens=output.num_cached_tokens,
    )
