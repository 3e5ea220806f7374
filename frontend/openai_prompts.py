"""A request's prompts as text and token ids: a completions ``prompt`` or a pooling
``input`` (a string, token ids, or a batch of either), and chat ``messages`` rendered by the
chat template; a pooling prompt cut to ``truncate_prompt_tokens`` and refused when longer
than the context window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.frontend import tool_calls
from pagedserve.frontend.chat_request import render_chat_prompt
from pagedserve.frontend.chat_template import (
    SETTING_NAMES,
    ChatTemplateOptions,
    check_template_allowed,
    message_reasoning,
    with_reasoning_effort,
)
from pagedserve.frontend.openai_fields import invalid_field, typed_field
from pagedserve.frontend.request_contract import check_chat_role
from pagedserve.frontend.tool_calls import ToolCallError

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM


@dataclass
class Prompt:
    """One prompt of a request: its text (None when given as ids) and token ids."""

    text: str | None
    token_ids: list[int]


def completion_prompts(
    body: dict, llm: LLM, max_prompts: int, field: str = "prompt"
) -> list[Prompt]:
    """The prompts of a completions ``prompt`` (or an embeddings ``input``: ``field``):
    a string, token ids, or a batch of either."""
    prompt = body.get(field)
    if prompt is None:
        raise invalid_field(
            f"{field} is required: a string, a list of strings, or token ids", field
        )
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise invalid_field(
            f"{field} must be a string, a list of strings, a list of token ids or a list of "
            f"lists of token ids, and not empty; got {prompt!r:.200}",
            field,
        )
    if len(items) > max_prompts:
        raise invalid_field(
            f"{field}: a batch of {len(items)} prompts; this server takes at most "
            f"{max_prompts} (its max_concurrent_requests)",
            field,
        )
    prompts = []
    truncating = body.get("truncate_prompt_tokens") is not None
    for position, item in enumerate(items):
        name = field if len(items) == 1 else f"{field}[{position}]"
        if not isinstance(item, (str, list)) or isinstance(item, bool):
            raise invalid_field(
                f"{name} must be a string or a list of token ids, got {item!r:.200}", name
            )
        try:
            if not truncating:  # cheap, before the tokenizer spends seconds on it
                llm.check_prompt_size(item, name)
            token_ids = llm.encode_prompt(item, name)
        except (ValueError, TypeError) as error:
            raise invalid_field(str(error), name) from None
        prompts.append(Prompt(item if isinstance(item, str) else None, token_ids))
    return prompts


def chat_prompt(
    body: dict,
    llm: LLM,
    trust_request_chat_template: bool = False,
    opens_turn_default: bool = True,
) -> Prompt:
    """The prompt of a chat request: its messages (and tools, when it gives them) through
    the model's chat template (or the request's own, when the server trusts its clients
    with one). ``opens_turn_default``: ``add_generation_prompt`` when the body leaves it
    unset (a pooling request's conversation ends with its last message, as vLLM's)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_field(
            f"messages must be a non-empty list of {{role, content}} objects, got "
            f"{messages!r:.200}",
            "messages",
        )
    conversation = []
    for position, message in enumerate(messages):
        name = f"messages[{position}]"
        if not isinstance(message, dict):
            raise invalid_field(f"{name} must be an object, got {message!r:.200}", name)
        try:
            role = check_chat_role(message.get("role"), f"{name}.role")
        except ValueError as error:
            raise invalid_field(str(error), f"{name}.role") from None
        entry = {"role": role, "content": message_text(message, name)}
        try:
            entry.update(tool_calls.chat_message_tool_fields(message, name))
        except ToolCallError as error:
            raise invalid_field(str(error), error.field) from None
        entry.update(_message_reasoning(message, name))
        conversation.append(entry)
    tools = None
    if body.get("tools") is not None:
        try:
            tools = [tool.definition for tool in tool_calls.parse_tools(body["tools"])]
        except ToolCallError as error:
            raise invalid_field(str(error), error.field) from None
    # vLLM's: a new assistant turn (the default), or the last message left open to go on.
    opens_turn = typed_field(
        body, "add_generation_prompt", (bool,), "a boolean", opens_turn_default
    )
    continues = typed_field(body, "continue_final_message", (bool,), "a boolean", False)
    # vLLM's: more variables for the template (a Qwen3-style {"enable_thinking": false}),
    # a RAG template's documents, and a template of the request's own (a server that
    # trusts its clients with one: a template is code the server runs).
    template = body.get("chat_template")
    try:
        template_kwargs = with_reasoning_effort(
            body.get("chat_template_kwargs"), body.get("reasoning_effort")
        )
    except ValueError as error:
        raise invalid_field(str(error), "reasoning_effort") from None
    try:
        check_template_allowed(template, trust_request_chat_template)
        options = ChatTemplateOptions(
            add_generation_prompt=opens_turn,
            continue_final_message=continues,
            chat_template_kwargs=template_kwargs,
            documents=body.get("documents"),
            chat_template=template,
        )
        text, token_ids = render_chat_prompt(
            llm,
            conversation,
            tools,
            "messages",
            options,
            check_size=body.get("truncate_prompt_tokens") is None,
        )
    except (ValueError, TypeError) as error:
        message = str(error)
        name = next((name for name in SETTING_NAMES if message.startswith(name)), "messages")
        raise invalid_field(message, name) from None
    return Prompt(text, token_ids)


def _message_reasoning(message: dict, name: str) -> dict[str, str]:
    """An assistant message's reported thinking (``reasoning_content``, or ``reasoning``) for
    the template (``chat_template.message_reasoning``)."""
    for field_name in ("reasoning_content", "reasoning"):
        if message.get(field_name) is not None:
            field = f"{name}.{field_name}"
            try:
                return message_reasoning(message.get("role"), message[field_name], field)
            except ValueError as error:
                raise invalid_field(str(error), field) from None
    return {}


def message_text(message: dict, name: str) -> str:
    content = message.get("content")
    return "" if content is None else content_text(content, f"{name}.content")


def content_text(content: Any, name: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """A message's content (field ``name``) as one text: a string, or a list of text
    parts of ``part_types``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_field(
            f"{name} must be a string or a list of text parts, got {content!r:.200}", name
        )
    texts = []
    for position, part in enumerate(content):
        part_name = f"{name}[{position}]"
        if not isinstance(part, dict) or part.get("type") not in part_types:
            kind = part.get("type") if isinstance(part, dict) else part
            types = ", ".join(map(repr, part_types))
            raise invalid_field(
                f"{part_name}: only text parts are supported (type {types}), got {kind!r:.100}",
                part_name,
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_field(f"{part_name}.text must be a string, got {text!r:.100}", part_name)
        texts.append(text)
    return "".join(texts)


def input_names(count: int) -> list[str]:
    """Each of a pooling request's ``input`` prompts' field, as errors name it."""
    return ["input"] if count == 1 else [f"input[{i}]" for i in range(count)]


# vLLM's chat form of a pooling request (its EmbeddingChatRequest, ClassificationChatRequest):
# ``messages`` instead of ``input``, rendered by the chat template.
POOLING_CHAT_FIELDS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
    }
)


def pooling_input_prompts(
    body: dict, llm: LLM, max_prompts: int, trust_request_chat_template: bool
) -> tuple[list[Prompt], bool]:
    """The prompts of an embeddings or classify body, and whether they came from a
    conversation: ``input`` (``pooling_prompts``) or, as vLLM's chat form, ``messages``
    through the chat template, one prompt ending with the last message (no assistant turn
    unless ``add_generation_prompt``), cut as ``truncate_prompt_tokens`` says."""
    if body.get("messages") is None:
        for name in sorted(POOLING_CHAT_FIELDS - {"messages"}):
            if body.get(name) is not None:
                raise invalid_field(f"{name} is a chat setting: it needs messages", name)
        if body.get("input") is None:
            raise invalid_field(
                "input is required (a string, a list of strings, or token ids), or messages "
                "for a conversation rendered with the chat template",
                "input",
            )
        return pooling_prompts(body, llm, max_prompts, "input"), False
    if body.get("input") is not None:
        raise invalid_field(
            "messages and input are both set: give the prompts as input, or one "
            "conversation as messages",
            "messages",
        )
    chat_body = {name: body[name] for name in POOLING_CHAT_FIELDS if name in body}
    prompt = chat_prompt(chat_body, llm, trust_request_chat_template, opens_turn_default=False)
    truncate = truncate_prompt_tokens(body, llm)
    if truncate is not None and len(prompt.token_ids) > truncate:
        prompt = Prompt(None, prompt.token_ids[-truncate:])
    check_prompt_length(prompt, llm, "messages")
    return [prompt], True


def pooling_prompts(body: dict, llm: LLM, max_prompts: int, field: str) -> list[Prompt]:
    """The prompts of a pooling request's ``field`` (the embeddings' ``input``, a score's
    ``text_1``, ...): a string, token ids, or a batch of either, each cut to its last
    ``truncate_prompt_tokens`` tokens (-1: the context window), as vLLM does, and refused
    if longer than the context window."""
    prompts = completion_prompts(body, llm, max_prompts, field)
    truncate = truncate_prompt_tokens(body, llm)
    for position, prompt in enumerate(prompts):
        if truncate is not None and len(prompt.token_ids) > truncate:
            prompts[position] = Prompt(None, prompt.token_ids[-truncate:])
        name = field if len(prompts) == 1 else f"{field}[{position}]"
        check_prompt_length(prompts[position], llm, name)
    return prompts


def truncate_prompt_tokens(body: dict, llm: LLM) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: how many tokens a prompt keeps at most (-1: the
    context window); None: no cut."""
    max_model_len = llm.scheduler_config.max_model_len
    truncate = typed_field(body, "truncate_prompt_tokens", (int,), "an integer")
    if truncate == -1:
        truncate = max_model_len
    if truncate is not None and not 1 <= truncate <= max_model_len:
        raise invalid_field(
            f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the model's "
            f"context window), got {truncate}",
            "truncate_prompt_tokens",
        )
    return truncate


def check_prompt_length(prompt: Prompt, llm: LLM, name: str) -> None:
    """A pooling prompt longer than the context window is refused, naming its field."""
    max_model_len = llm.scheduler_config.max_model_len
    num_prompt_tokens = len(prompt.token_ids)
    if num_prompt_tokens > max_model_len:
        raise invalid_field(
            f"{name}: {num_prompt_tokens} prompt tokens exceed the model's context window "
            f"of {max_model_len} tokens (truncate_prompt_tokens can cut them)",
            name,
        )
