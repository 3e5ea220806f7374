"""The tool calling tests' tools, template and conversations, and readers of the calls in
a chat answer, whole or streamed."""

from __future__ import annotations

# A ChatML template that lists the tools' functions in a system turn (compact JSON: the
# byte-level tokenizer spends a token per character, and the context is 512), writes an
# assistant's calls as hermes' <tool_call> blocks and a tool's result as a turn of its own;
# it refuses developer messages, as real templates refuse what they cannot show.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}"
    "{{ tool['function'] | tojson(separators=(',', ':')) }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'developer' %}"
    "{{ raise_exception('no developer turns here') }}{% endif %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{% else %}{{ m['content'] }}"
    "{% for call in m['tool_calls'] or [] %}<tool_call>{\"name\": "
    "{{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def enum_object(key: str, values: list[str]) -> dict:
    """A one-key object schema that a random model completes in a few tokens."""
    return {
        "type": "object",
        "properties": {key: {"enum": values}},
        "required": [key],
        "additionalProperties": False,
    }


WEATHER = enum_object("city", ["Paris", "Rome"])
TIME = enum_object("zone", ["UTC", "CET"])
# As OpenAI documents a tool (name, description, parameters); the template prints them so.
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
ONE_TOOL = TOOLS[:1]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
MAX_TOKENS = 48
# Two complete calls of the required choice's array and part of a third.
REQUIRED_MAX_TOKENS = 120
# A call in hermes' format, for a regex in the request to force on the model.
CHECKING_CALL = (
    r'Checking\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}'
    r"</tool_call>"
)
# A conversation after a call: the assistant's call (arguments as a JSON string, as OpenAI
# sends them) and the tool's result; with the one tool it called, to fit the context.
CONVERSATION = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]
# The same as the template gets it: arguments as an object, no content as "".
CONVERSATION_RENDERED = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def streamed_calls(events: list) -> tuple[str, list[dict], list[dict], list[str | None]]:
    """A chat stream read back: its content, its calls (each delta's arguments joined,
    the id of the delta that named the call), every tool-call delta, and each chunk's
    finish_reason."""
    assert events[-1] == "[DONE]"
    content = ""
    calls: list[dict] = []
    deltas: list[dict] = []
    finishes = []
    for chunk in events[:-1]:
        (choice,) = chunk["choices"]
        finishes.append(choice["finish_reason"])
        content += choice["delta"].get("content") or ""
        for delta in choice["delta"].get("tool_calls", []):
            deltas.append(delta)
            if delta["index"] == len(calls):
                calls.append(
                    {
                        "id": delta["id"],
                        "type": delta["type"],
                        "name": delta["function"]["name"],
                        "arguments": "",
                    }
                )
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls, deltas, finishes


def whole_calls(message: dict) -> list[dict]:
    """A whole chat answer's calls, shaped as ``streamed_calls`` gives them."""
    return [
        {
            "id": call["id"],
            "type": call["type"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
        }
        for call in message.get("tool_calls") or []
    ]


def without_ids(calls: list[dict]) -> list[dict]:
    """The calls without their ids, which differ between two answers."""
    return [{key: value for key, value in call.items() if key != "id"} for call in calls]
