"""Tool calling's request reading and output reading (frontend/tool_calls.py), without a
model: tools and tool_choice checked with the field named; the schemas that make required
and named calls compile and admit exactly the calls; each parser on the model formats it
reads; and a stream, fed the output a character at a time, adds up to the whole answer."""

from __future__ import annotations

import json

import llguidance
import pytest

from helpers.tiny_tokenizers import byte_level_tokenizer
from pagedserve.frontend.tool_calls import (
    ParsedCall,
    ParsedOutput,
    ToolCallError,
    ToolCalling,
    ToolCallStream,
    chat_message_tool_fields,
    parse_tools,
    with_ids,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = parse_tools([WEATHER, TIME])


def calling(tool_choice, parser=None, parallel=True) -> ToolCalling:
    return ToolCalling(TOOLS, tool_choice, parallel, parser)


def field_of(tools=None, tool_choice="auto", parser="hermes") -> str:
    with pytest.raises(ToolCallError) as caught:
        ToolCalling(
            parse_tools(tools if tools is not None else [WEATHER]), tool_choice, True, parser
        )
    return caught.value.field


def test_tools_are_checked_naming_the_field():
    assert field_of(tools=[]) == "tools"
    assert field_of(tools=[{"type": "code_interpreter"}]) == "tools[0].type"
    assert field_of(tools=[WEATHER, {"type": "function"}]) == "tools[1].function"
    bad_name = {"type": "function", "function": {"name": "get weather"}}
    assert field_of(tools=[bad_name]) == "tools[0].function.name"
    assert field_of(tools=[WEATHER, WEATHER]) == "tools[1].function.name"
    bad_parameters = {"type": "function", "function": {"name": "f", "parameters": "x"}}
    assert field_of(tools=[bad_parameters]) == "tools[0].function.parameters"
    bad_description = {"type": "function", "function": {"name": "f", "description": 3}}
    assert field_of(tools=[bad_description]) == "tools[0].function.description"


def test_tool_choice_is_checked_naming_the_field():
    assert field_of(tool_choice="sometimes") == "tool_choice"
    assert field_of(tool_choice={"type": "function"}) == "tool_choice"
    named_other = {"type": "function", "function": {"name": "get_time"}}
    assert field_of(tool_choice=named_other) == "tool_choice.function.name"
    # "auto" (also the default) reads the model's own format: the server must have a parser.
    assert field_of(tool_choice="auto", parser=None) == "tool_choice"
    assert field_of(tool_choice=None, parser=None) == "tool_choice"
    for mode in ("none", "required"):
        assert ToolCalling(TOOLS, mode, True, None).mode == mode
    named = calling({"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and named.named is not None and named.named.name == "get_time"


def test_the_template_gets_openais_tool_definitions():
    # As the client wrote them, in its order (templates print them), without unknown fields.
    shuffled = {"parameters": {"type": "object"}, "name": "f", "x-private": 1}
    tools = parse_tools([WEATHER, TIME, {"type": "function", "function": shuffled}])
    assert [tool.definition for tool in tools] == [
        WEATHER,
        TIME,
        {"type": "function", "function": {"parameters": {"type": "object"}, "name": "f"}},
    ]
    assert list(tools[2].definition["function"]) == ["parameters", "name"]
    assert tools[1].parameters["properties"] == {}  # no parameters: none may be given


def matches(schema: dict, text: str) -> bool:
    """Whether llguidance, given ``schema``, accepts ``text`` as a whole output (over a
    byte-per-token vocabulary, so the text is checked exactly, whatever its tokens)."""
    vocabulary = byte_level_tokenizer([])
    tokenizer = llguidance.LLTokenizer(vocabulary.to_str(), n_vocab=vocabulary.get_vocab_size())
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema))
    assert not matcher.get_error(), matcher.get_error()
    tokens = vocabulary.encode(text).ids
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def test_required_and_named_schemas_admit_exactly_the_calls():
    name, schema = calling("required").constraint()
    assert name == "tools"
    paris = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}]'
    two = paris[:-1] + ', {"name": "get_time", "parameters": {}}]'
    assert matches(schema, paris) and matches(schema, two)
    assert not matches(schema, "[]")  # at least one call
    assert not matches(schema, '[{"name": "get_date", "parameters": {}}]')  # not a tool
    assert not matches(schema, '[{"name": "get_weather", "parameters": {"unit": "C"}}]')
    assert not matches(schema, '[{"name": "get_time", "parameters": {"x": 1}}]')
    _, single = calling("required", parallel=False).constraint()
    assert matches(single, paris) and not matches(single, two)
    name, named = calling({"type": "function", "function": {"name": "get_weather"}}).constraint()
    assert name == "tools[0].function.parameters"
    assert matches(named, '{"city": "Rome"}') and not matches(named, '{"unit": "F"}')
    assert calling("none").constraint() is None
    assert calling("auto", "hermes").constraint() is None


HERMES_TEXTS = [
    "No call here.",
    "<tool_call>\n" + json.dumps({"name": "get_time", "arguments": {}}) + "\n</tool_call>",
    "Checking.\n<tool_call>\n"
    + json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    + "\n</tool_call>\n<tool_call>\n"
    + json.dumps({"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}})
    + "\n</tool_call>",
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone, one more: '
    '<tool_call>{"name": "get_time"}',  # the output ended inside a block
    "A <tool_call>not json</tool_call> and < signs <tool_",
    "a < b <tool_call>",
]


def test_hermes_reads_calls_and_keeps_the_rest_as_content():
    hermes = calling("auto", "hermes")
    assert hermes.parse(HERMES_TEXTS[0], True) == ParsedOutput("No call here.")
    assert hermes.parse(HERMES_TEXTS[1], True) == ParsedOutput("", [ParsedCall("get_time", "{}")])
    two = hermes.parse(HERMES_TEXTS[2], True)
    assert two.content == "Checking.\n"
    assert two.calls == [
        ParsedCall("get_weather", '{"city": "Paris"}'),
        ParsedCall("get_weather", '{"city": "Rome", "unit": "C"}'),
    ]
    cut = hermes.parse(HERMES_TEXTS[3], True)
    assert cut.content == "\nDone, one more: "
    assert cut.calls == [ParsedCall("get_time", "{}"), ParsedCall("get_time", "{}")]
    # A block without a call stays as written; so does a half-written tag at the end.
    junk = hermes.parse(HERMES_TEXTS[4], True)
    assert junk == ParsedOutput("A <tool_call>not json</tool_call> and < signs <tool_")
    assert hermes.parse(HERMES_TEXTS[5], True) == ParsedOutput("a < b <tool_call>")
    # While streaming, a possible tag start and an open block are held back.
    assert hermes.parse("Sure <tool", False).content == "Sure "
    assert hermes.parse("Sure <tool_call>{", False) == ParsedOutput("Sure ")


def test_parallel_tool_calls_false_keeps_the_first_call():
    single = calling("auto", "hermes", parallel=False)
    assert [c.arguments for c in single.parse(HERMES_TEXTS[2], True).calls] == ['{"city": "Paris"}']


LLAMA_TEXTS = [
    "The weather is fine.",
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "get_time", "parameters": {}}; '
    '{"name": "get_weather", "parameters": {"city": "Lima"}}',
    '{"name": "get_weather", "parameters": {"city": "Os',  # cut short: not a call
    "  {not json at all}",
]


def test_llama3_json_reads_whole_outputs_of_calls():
    llama = calling("auto", "llama3_json")
    assert llama.parse(LLAMA_TEXTS[0], True) == ParsedOutput("The weather is fine.")
    assert llama.parse(LLAMA_TEXTS[1], True).calls == [
        ParsedCall("get_weather", '{"city": "Oslo"}')
    ]
    assert [c.name for c in llama.parse(LLAMA_TEXTS[2], True).calls] == ["get_time", "get_weather"]
    assert llama.parse(LLAMA_TEXTS[3], True) == ParsedOutput(LLAMA_TEXTS[3])
    assert llama.parse(LLAMA_TEXTS[4], True) == ParsedOutput(LLAMA_TEXTS[4])
    assert llama.parse("The", False) == ParsedOutput("The")  # text: streams at once
    assert llama.parse("<|py", False) == ParsedOutput("")  # undecided


PYTHONIC_TEXTS = [
    '[get_weather(city="Paris", unit="C"), get_time()]',
    "<|python_start|>[get_weather(city='Oslo', days=[1, 2])]<|python_end|>",
    "[1] First, a list item.",  # a list, not calls: content
    "[get_weather(city=x)]",  # a name, not a literal
    "[get_weather({1, 2})]",  # a positional argument
    "[get_weather(tags={1, 2})]",  # a set has no JSON form
    "The weather is fine.",
]


def test_pythonic_reads_a_list_of_calls_with_literal_keywords():
    pythonic = calling("auto", "pythonic")
    assert pythonic.parse(PYTHONIC_TEXTS[0], True).calls == [
        ParsedCall("get_weather", '{"city": "Paris", "unit": "C"}'),
        ParsedCall("get_time", "{}"),
    ]
    assert pythonic.parse(PYTHONIC_TEXTS[1], True) == ParsedOutput(
        "", [ParsedCall("get_weather", '{"city": "Oslo", "days": [1, 2]}')]
    )
    for text in PYTHONIC_TEXTS[2:]:
        assert pythonic.parse(text, True) == ParsedOutput(text)
    assert pythonic.parse("[get_wea", False) == ParsedOutput("")  # undecided until the end
    assert pythonic.parse("The", False) == ParsedOutput("The")


def test_vllm_s_llama4_parser_names_read_as_their_llama_3_readers():
    text = "<|python_start|>[get_weather(city='Oslo', days=[1, 2])]<|python_end|>"
    llama4 = calling("auto", "llama4_pythonic").parse(text, True)
    assert llama4 == calling("auto", "pythonic").parse(text, True)
    assert llama4.calls == [ParsedCall("get_weather", '{"city": "Oslo", "days": [1, 2]}')]
    json_text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    llama4_json = calling("auto", "llama4_json").parse(json_text, True)
    assert llama4_json == calling("auto", "llama3_json").parse(json_text, True)
    assert llama4_json.calls == [ParsedCall("get_weather", '{"city": "Paris"}')]


REQUIRED_TEXTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"name": "get_time", "parameters": {}}]',
    '[ {"name": "get_time", "parameters": {}} , {"name": "get_weather", "parameters": {"ci',
    '[{"name": "get_weather", "param',  # cut short before any call: content
]


def test_required_reads_each_complete_call():
    required = calling("required")
    assert required.parse(REQUIRED_TEXTS[0], True).calls == [
        ParsedCall("get_weather", '{"city": "Paris"}'),
        ParsedCall("get_time", "{}"),
    ]
    assert required.parse(REQUIRED_TEXTS[1], True) == ParsedOutput(
        "", [ParsedCall("get_time", "{}")]
    )
    assert required.parse(REQUIRED_TEXTS[2], True) == ParsedOutput(REQUIRED_TEXTS[2])
    assert required.parse(REQUIRED_TEXTS[2], False) == ParsedOutput("")


MISTRAL_TEXTS = [
    "No call here.",
    'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "unit": "C"}[TOOL_CALLS]get_time[ARGS]{}',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Ro',  # cut short before any call: content
    "[TOOL_CALLS] not a call",
    '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_wea',  # one complete
]


def test_mistral_reads_both_of_its_formats():
    mistral = calling("auto", "mistral")
    assert mistral.parse(MISTRAL_TEXTS[0], True) == ParsedOutput("No call here.")
    assert mistral.parse(MISTRAL_TEXTS[1], True) == ParsedOutput(
        "Checking. ",
        [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", "{}")],
    )
    assert mistral.parse(MISTRAL_TEXTS[2], True).calls == [
        ParsedCall("get_weather", '{"city": "Rome", "unit": "C"}'),
        ParsedCall("get_time", "{}"),
    ]
    for text in MISTRAL_TEXTS[3:5]:
        assert mistral.parse(text, True) == ParsedOutput(text)
    assert mistral.parse(MISTRAL_TEXTS[5], True).calls == [ParsedCall("get_time", "{}")]
    # While streaming, a possible [TOOL_CALLS] is held back, and a call waits for its JSON.
    assert mistral.parse("Sure [TOOL_", False) == ParsedOutput("Sure ")
    assert mistral.parse(MISTRAL_TEXTS[3], False) == ParsedOutput("")


QWEN3_CODER_TEXTS = [
    "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
    "</parameter>\n<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n"
    "<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n<parameter=tags>\n['a', 'b']\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOs",  # cut short, still a call
    "<tool_call>no function here</tool_call>",
]


def test_qwen3_coder_reads_xml_calls_typed_by_their_schema():
    coder = calling("auto", "qwen3_coder")
    assert coder.parse(QWEN3_CODER_TEXTS[0], True) == ParsedOutput(
        "Let me look.\n", [ParsedCall("get_weather", '{"city": "New York", "unit": "C"}')]
    )
    # city is a string in the schema, whatever it looks like; untyped values read as
    # JSON (or Python) when they can.
    assert coder.parse(QWEN3_CODER_TEXTS[1], True).calls == [
        ParsedCall("get_time", "{}"),
        ParsedCall("get_weather", '{"city": "42", "days": 3, "tags": ["a", "b"]}'),
    ]
    assert coder.parse(QWEN3_CODER_TEXTS[2], True).calls == [
        ParsedCall("get_weather", '{"city": "Os"}')
    ]
    assert coder.parse(QWEN3_CODER_TEXTS[3], True) == ParsedOutput(QWEN3_CODER_TEXTS[3])


SEED_OSS_TEXTS = [
    text.replace("<tool_call>", "<seed:tool_call>").replace("</tool_call>", "</seed:tool_call>")
    for text in QWEN3_CODER_TEXTS
]


def test_seed_oss_reads_qwen3_coder_s_xml_in_its_own_blocks():
    seed, coder = calling("auto", "seed_oss"), calling("auto", "qwen3_coder")
    for seed_text, coder_text in zip(SEED_OSS_TEXTS[:3], QWEN3_CODER_TEXTS, strict=False):
        assert seed.parse(seed_text, True) == coder.parse(coder_text, True)
    assert seed.parse(SEED_OSS_TEXTS[3], True) == ParsedOutput(SEED_OSS_TEXTS[3])
    # Qwen3-Coder's own blocks are not Seed-OSS's: content.
    assert seed.parse(QWEN3_CODER_TEXTS[0], True) == ParsedOutput(QWEN3_CODER_TEXTS[0])


B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_V3_TEXTS = [
    "No call here.",
    f'Let me check.{B}{CB}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CE}'
    f"{CB}function{SEP}get_time\n```json\n{{}}\n```{CE}{E}",
    f'{B}{CB}function{SEP}get_weather\n```json\n{{"city": "Ro',  # cut short: content
    f"{B}{CB}function{SEP}get_time\n```json\n{{}}\n```{CE}{E} Done.",
    f"{B}{CB}function{SEP}not a name\n```json\n{{}}\n```{CE}{E}",
    f"Hi{B}{CB}function{SEP}not a name\n```json\n{{}}\n```{CE}{E} Done.",  # all content
]
DEEPSEEK_V31_TEXTS = [
    f'Sure.{B}{CB}get_weather{SEP}{{"city": "Rome", "unit": "C"}}{CE}{CB}get_time{SEP}{{}}{CE}{E}',
    f"{B}{CB}get_time{SEP}{{}}",  # the output ended inside the call, which reads whole
    f"{B}{CB}get_weather{SEP}[1, 2]{CE}{E}",
]


def test_deepseek_reads_v3_and_v31_calls():
    v3 = calling("auto", "deepseek_v3")
    assert v3.parse(DEEPSEEK_V3_TEXTS[0], True) == ParsedOutput("No call here.")
    assert v3.parse(DEEPSEEK_V3_TEXTS[1], True) == ParsedOutput(
        "Let me check.",
        [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", "{}")],
    )
    for text in (DEEPSEEK_V3_TEXTS[2], DEEPSEEK_V3_TEXTS[4], DEEPSEEK_V3_TEXTS[5]):
        assert v3.parse(text, True) == ParsedOutput(text)
    assert v3.parse(DEEPSEEK_V3_TEXTS[3], True) == ParsedOutput(
        " Done.", [ParsedCall("get_time", "{}")]
    )
    # While streaming, a possible begin marker is held back; a call waits for its end.
    assert v3.parse("Sure <｜tool▁ca", False) == ParsedOutput("Sure ")
    assert v3.parse(DEEPSEEK_V3_TEXTS[2], False) == ParsedOutput("")
    # Text after a section of no calls waits: the whole output may be content.
    assert v3.parse(DEEPSEEK_V3_TEXTS[5], False) == ParsedOutput("Hi")
    v31 = calling("auto", "deepseek_v31")
    assert v31.parse(DEEPSEEK_V31_TEXTS[0], True) == ParsedOutput(
        "Sure.",
        [ParsedCall("get_weather", '{"city": "Rome", "unit": "C"}'), ParsedCall("get_time", "{}")],
    )
    assert v31.parse(DEEPSEEK_V31_TEXTS[1], True).calls == [ParsedCall("get_time", "{}")]
    assert v31.parse(DEEPSEEK_V31_TEXTS[1], False).calls == []
    assert v31.parse(DEEPSEEK_V31_TEXTS[2], True) == ParsedOutput(DEEPSEEK_V31_TEXTS[2])
    # Each version's calls are not the other's.
    assert v31.parse(DEEPSEEK_V3_TEXTS[1], True) == ParsedOutput(DEEPSEEK_V3_TEXTS[1])


KB, KE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KCB, KCE, KARG = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
KIMI_K2_TEXTS = [
    "No call here.",
    f'Some content{KB}{KCB}functions.get_weather:0{KARG}{{"city": "Beijing"}}{KCE}'
    f"{KCB}functions.get_time:1{KARG}{{}}{KCE}{KE}",
    # The singular section markers, whitespace between markers, no "functions." prefix.
    f"<|tool_call_section_begin|>\n{KCB} get_time:3 \n{KARG} {{}} {KCE}\n"
    "<|tool_call_section_end|>\n",
    f"{KB}{KCB}functions.get_time:0{KARG}{{}}{KCE}{KE} Done.",
    f'{KB}{KCB}functions.get_weather:0{KARG}{{"city": "Be',  # cut short: content
    f"Sure.{KB}{KCB}functions.get_time:0{KARG}{{}}",  # ended inside a call that reads whole
    f"{KB}{KCB}functions.get_weather:0{KARG}[1, 2]{KCE}{KE} After.",  # not an object
    f"{KB}{KCB}functions.get_time{KARG}{{}}{KCE}{KE}",  # no index in the id
    f"{KB}{KCB}functions.get weather:0{KARG}{{}}{KCE}{KE}",  # not a function name
    f"{KB}{KCB}functions.get_time:0{KARG}{{}}{KCE}{KCB}functions.get_weather:1{KARG}"
    f"not json{KCE}{KE}",  # the first block that is not a call ends the calls
    f"{KB}{KCB}functions.get_time:0{KARG}{{}}{KCE}{KCB}functions.get_time:0{KARG}"
    f'{{"zone": "CET"}}{KCE}{KE}',  # an id written twice
    f"a {KCB}get_time:0{KARG}{{}}{KCE} <|tool_calls_sec",  # no section: content
]


def test_kimi_k2_reads_its_section_of_calls_with_the_model_s_ids():
    kimi = calling("auto", "kimi_k2")
    assert kimi.parse(KIMI_K2_TEXTS[0], True) == ParsedOutput("No call here.")
    two = kimi.parse(KIMI_K2_TEXTS[1], True)
    assert two == ParsedOutput(
        "Some content",
        [
            ParsedCall("get_weather", '{"city": "Beijing"}', "functions.get_weather:0"),
            ParsedCall("get_time", "{}", "functions.get_time:1"),
        ],
    )
    # A whole answer's calls keep the model's ids (Kimi's template writes them back).
    assert [call.id for call in with_ids(two.calls)] == [
        "functions.get_weather:0",
        "functions.get_time:1",
    ]
    assert kimi.parse(KIMI_K2_TEXTS[2], True) == ParsedOutput(
        "", [ParsedCall("get_time", "{}", "get_time:3")]
    )
    assert kimi.parse(KIMI_K2_TEXTS[3], True) == ParsedOutput(
        " Done.", [ParsedCall("get_time", "{}", "functions.get_time:0")]
    )
    assert kimi.parse(KIMI_K2_TEXTS[5], True) == ParsedOutput(
        "Sure.", [ParsedCall("get_time", "{}", "functions.get_time:0")]
    )
    for text in (KIMI_K2_TEXTS[4], *KIMI_K2_TEXTS[6:9], KIMI_K2_TEXTS[11]):
        assert kimi.parse(text, True) == ParsedOutput(text)
    assert kimi.parse(KIMI_K2_TEXTS[9], True) == ParsedOutput(
        "", [ParsedCall("get_time", "{}", "functions.get_time:0")]
    )
    # Two calls may not share an id: the repeat gets a new one of the server's.
    repeated = kimi.parse(KIMI_K2_TEXTS[10], True).calls
    assert [call.id for call in repeated] == ["functions.get_time:0", None]
    assert with_ids(repeated)[1].id.startswith("call_")
    single = calling("auto", "kimi_k2", parallel=False)
    assert [call.name for call in single.parse(KIMI_K2_TEXTS[1], True).calls] == ["get_weather"]
    # DeepSeek's markers are not Kimi's: content.
    assert kimi.parse(DEEPSEEK_V31_TEXTS[0], True) == ParsedOutput(DEEPSEEK_V31_TEXTS[0])
    # While streaming, a possible section start (either spelling) is held back, a call waits
    # for its end marker, and text after a section waits for a call in it.
    assert kimi.parse("Sure <|tool_calls_sec", False) == ParsedOutput("Sure ")
    assert kimi.parse("Sure <|tool_call_sec", False) == ParsedOutput("Sure ")
    first_call_end = KIMI_K2_TEXTS[1].index(KCE) + len(KCE)
    assert kimi.parse(KIMI_K2_TEXTS[1][: first_call_end - 1], False) == ParsedOutput("Some content")
    assert kimi.parse(KIMI_K2_TEXTS[1][:first_call_end], False) == ParsedOutput(
        "Some content",
        [ParsedCall("get_weather", '{"city": "Beijing"}', "functions.get_weather:0")],
    )
    assert kimi.parse(KIMI_K2_TEXTS[5], False) == ParsedOutput("Sure.")
    assert kimi.parse(KIMI_K2_TEXTS[6], False) == ParsedOutput("")
    assert {KB, "<|tool_call_section_end|>", KCB, KARG, KCE} <= set(kimi.markers)


GRANITE_TEXTS = [
    '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {}}]',
    ' <tool_call> [{"name": "get_time", "arguments": {}}]\n',  # Granite 3.1's marker text
    '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "F"}}]',
    "The weather is fine.",
    '<|tool_call|>[{"name": "get_time"}] and then some text',  # more than calls: content
    "[1, 2, 3]",  # a list, not calls
    '<|tool_call|>{"name": "get_time", "arguments": {}}',  # not an array
    "<|tool_call|>",
]


def test_granite_reads_a_json_array_of_calls():
    granite = calling("auto", "granite")
    assert granite.parse(GRANITE_TEXTS[0], True) == ParsedOutput(
        "",
        [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", "{}")],
    )
    assert granite.parse(GRANITE_TEXTS[1], True).calls == [ParsedCall("get_time", "{}")]
    assert granite.parse(GRANITE_TEXTS[2], True).calls == [
        ParsedCall("get_weather", '{"city": "Oslo", "unit": "F"}')
    ]
    for text in GRANITE_TEXTS[3:]:
        assert granite.parse(text, True) == ParsedOutput(text)
    # Streaming: text goes at once; what may still be calls waits for the end.
    assert granite.parse("The", False) == ParsedOutput("The")
    assert granite.parse("<|tool", False) == ParsedOutput("")
    assert granite.parse("<tool_call> [", False) == ParsedOutput("")
    assert granite.parse("<tool_call> The", False) == ParsedOutput("<tool_call> The")


PHI4_MINI_TEXTS = [
    'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "parameters": {}}]',
    "The weather is fine.",
    '[{"name": "get_time", "arguments": {}}]',  # no functools: content
    "functools is a Python module.",
    'functools[{"name": "get_time", "arguments": {}}',  # cut short
]


def test_phi4_mini_reads_functools_arrays():
    phi = calling("auto", "phi4_mini_json")
    assert phi.parse(PHI4_MINI_TEXTS[0], True) == ParsedOutput(
        "",
        [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", "{}")],
    )
    for text in PHI4_MINI_TEXTS[1:]:
        assert phi.parse(text, True) == ParsedOutput(text)
    assert phi.parse("func", False) == ParsedOutput("")  # undecided
    assert phi.parse("functools is", False) == ParsedOutput("functools is")


GLM45_TEXTS = [
    "Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    # No arguments (with and without a newline), and pairs with no layout between tags.
    "<tool_call>get_time</tool_call>\n<tool_call>get_time\n</tool_call>\n<tool_call>get_weather"
    "<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>unit</arg_key>  \n "
    "<arg_value>C</arg_value></tool_call>",
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Os",  # cut short: content
    "<tool_call>get weather\n</tool_call>",  # not a function name
    "<tool_call>get_weather\nstray text<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
    "</tool_call>",  # more than the name before the arguments
    "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Oslo</arg_value> and more"
    "</tool_call>",  # more than pairs after them
    "<tool_call>get_time\n<arg_key> </arg_key><arg_value>x</arg_value></tool_call>",  # no key
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',  # Hermes' JSON: not GLM's
    "Done: <tool_call>get_time</tool_call> then text <tool_",
]
FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "days": {"type": "integer"},
                "hourly": {"type": "boolean"},
                "where": {"type": "object"},
                "hours": {"type": "array"},
                "note": {"type": "string"},
                "scale": {"type": ["number", "null"]},
            },
        },
    },
}


def test_glm45_reads_key_value_calls_typed_by_their_schema():
    glm = calling("auto", "glm45")
    # city is a string in the schema, whatever it looks like; days is untyped: JSON.
    assert glm.parse(GLM45_TEXTS[0], True) == ParsedOutput(
        "Let me look.\n", [ParsedCall("get_weather", '{"city": "42", "days": 3}')]
    )
    assert glm.parse(GLM45_TEXTS[1], True) == ParsedOutput(
        "",
        [
            ParsedCall("get_time", "{}"),
            ParsedCall("get_time", "{}"),
            ParsedCall("get_weather", '{"city": "Rome", "unit": "C"}'),
        ],
    )
    for text in GLM45_TEXTS[2:8]:
        assert glm.parse(text, True) == ParsedOutput(text)
    assert glm.parse(GLM45_TEXTS[8], True) == ParsedOutput(
        "Done:  then text <tool_", [ParsedCall("get_time", "{}")]
    )
    single = calling("auto", "glm45", parallel=False)
    assert [call.name for call in single.parse(GLM45_TEXTS[1], True).calls] == ["get_time"]
    forecast = ToolCalling(parse_tools([FORECAST]), "auto", True, "glm45")
    values = {
        "days": "7",
        "hourly": "True",
        "where": '{"lat": 39.9, "lon": 116.4}',
        "hours": "[6, 12]",
        "note": " null \n",  # a string as written, spaces and all
        "scale": "null",
    }
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items()
    )
    call = forecast.parse(f"<tool_call>forecast\n{pairs}</tool_call>", True).calls[0]
    assert json.loads(call.arguments) == {
        "days": 7,
        "hourly": True,
        "where": {"lat": 39.9, "lon": 116.4},
        "hours": [6, 12],
        "note": " null \n",
        "scale": None,
    }
    # While streaming, a possible <tool_call> is held back, and a call waits for its end tag.
    assert glm.parse("Sure <tool_ca", False) == ParsedOutput("Sure ")
    assert glm.parse("Sure <tool_call>get_weather\n<arg_key>ci", False) == ParsedOutput("Sure ")
    closed = "<tool_call>get_time</tool_call>"
    assert glm.parse(closed + "\n<tool_call>get_w", False) == ParsedOutput(
        "", [ParsedCall("get_time", "{}")]
    )
    assert {"<tool_call>", "<arg_key>", "</arg_value>"} <= set(glm.markers)


MB, ME = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_M2_TEXTS = [
    # Content, then one block of two calls (a string stays a string, whatever it looks like).
    f'I will check both cities.\n{MB}\n<invoke name="get_weather">\n'
    '<parameter name="city">Paris</parameter>\n<parameter name="unit">C</parameter>\n'
    f'</invoke>\n<invoke name="get_weather">\n<parameter name="city">42</parameter>\n'
    f"</invoke>\n{ME}",
    # No parameters; single-quoted and bare names.
    f"{MB}\n<invoke name='get_time'>\n</invoke>\n<invoke name=get_weather>\n"
    f"<parameter name=city>Rome</parameter>\n</invoke>\n{ME}",
    # Two blocks: text between them is content, whitespace after the last is layout.
    f'{MB}<invoke name="get_time"></invoke>{ME}\nThen: {MB}\n<invoke name="get_time">'
    f"</invoke>\n{ME}\n",
    # Cut off inside the second call: the first counts, the second is no call.
    f'Sure.\n{MB}\n<invoke name="get_time">\n</invoke>\n<invoke name="get_weather">\n'
    '<parameter name="city">Os',
    # Cut off inside the first call: no call, all content.
    f'{MB}\n<invoke name="get_weather">\n<parameter name="city">Os',
    # A block without a call (not a function name) stays as written, and what follows it.
    f'A {MB}<invoke name="get weather"></invoke>{ME} b\n',
    # Qwen3-Coder's XML is not MiniMax's; nor is a marker's beginning.
    QWEN3_CODER_TEXTS[0],
    "x < y <minimax:tool",
]
WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {
                "content": {"type": "string"},
                "mode": {"enum": [420, 384]},
                "size": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            },
        },
    },
}


def test_minimax_m2_reads_invokes_typed_by_their_schema():
    minimax = calling("auto", "minimax_m2")
    assert minimax.parse(MINIMAX_M2_TEXTS[0], True) == ParsedOutput(
        "I will check both cities.\n",
        [
            ParsedCall("get_weather", '{"city": "Paris", "unit": "C"}'),
            ParsedCall("get_weather", '{"city": "42"}'),
        ],
    )
    assert minimax.parse(MINIMAX_M2_TEXTS[1], True) == ParsedOutput(
        "", [ParsedCall("get_time", "{}"), ParsedCall("get_weather", '{"city": "Rome"}')]
    )
    assert minimax.parse(MINIMAX_M2_TEXTS[2], True) == ParsedOutput(
        "\nThen: ", [ParsedCall("get_time", "{}"), ParsedCall("get_time", "{}")]
    )
    assert minimax.parse(MINIMAX_M2_TEXTS[3], True) == ParsedOutput(
        "Sure.\n", [ParsedCall("get_time", "{}")]
    )
    for text in MINIMAX_M2_TEXTS[4:]:
        assert minimax.parse(text, True) == ParsedOutput(text)
    single = calling("auto", "minimax_m2", parallel=False)
    assert single.parse(MINIMAX_M2_TEXTS[0], True).calls == [
        ParsedCall("get_weather", '{"city": "Paris", "unit": "C"}')
    ]
    assert {MB, ME} <= set(minimax.markers)
    # Each value typed by its schema: a type, a type list with null, an enum's values, an
    # anyOf; a string (and a parameter or function the schema does not type) as written.
    typed = ToolCalling(parse_tools([FORECAST, WRITE_FILE]), "auto", True, "minimax_m2")
    values = {
        "days": "7",
        "hourly": "True",
        "where": '{"lat": 39.9, "lon": 116.4}',
        "hours": "[6, 12]",
        "note": " null \n",
        "scale": "null",
        "extra": "[1, 2]",
    }
    forecast = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in values.items())
    code = "def area(r):\n    return 3.14 * r * r\n"
    write = (
        f'<parameter name="content">{code}</parameter>\n<parameter name="mode">420</parameter>\n'
        '<parameter name="size">12</parameter>\n'
    )
    unknown = '<parameter name="k">5</parameter>'
    calls = typed.parse(
        f'{MB}\n<invoke name="forecast">\n{forecast}</invoke>\n<invoke name="write_file">\n'
        f'{write}</invoke>\n<invoke name="search">{unknown}</invoke>\n{ME}',
        True,
    ).calls
    assert [call.name for call in calls] == ["forecast", "write_file", "search"]
    assert [json.loads(call.arguments) for call in calls] == [
        {
            "days": 7,
            "hourly": True,
            "where": {"lat": 39.9, "lon": 116.4},
            "hours": [6, 12],
            "note": " null \n",
            "scale": None,
            "extra": "[1, 2]",
        },
        {"content": code, "mode": 420, "size": 12},
        {"k": "5"},
    ]
    none_size = f'{MB}<invoke name="write_file"><parameter name="size">null</parameter></invoke>'
    assert typed.parse(none_size, True).calls == [ParsedCall("write_file", '{"size": null}')]


def test_minimax_m2_streams_each_call_once_its_invoke_is_closed():
    minimax = calling("auto", "minimax_m2")
    # A possible block start is held back; an open block holds back what follows it.
    assert minimax.parse("Sure <minimax:tool", False) == ParsedOutput("Sure ")
    first_call = MINIMAX_M2_TEXTS[0].index("</invoke>") + len("</invoke>")
    assert minimax.parse(MINIMAX_M2_TEXTS[0][: first_call - 1], False) == ParsedOutput(
        "I will check both cities.\n"
    )
    # The first call is sent before the block (and the second call) ends.
    assert minimax.parse(MINIMAX_M2_TEXTS[0][:first_call], False) == ParsedOutput(
        "I will check both cities.\n",
        [ParsedCall("get_weather", '{"city": "Paris", "unit": "C"}')],
    )
    # While an open block holds no call yet, it may still turn out to be content.
    assert minimax.parse(MINIMAX_M2_TEXTS[4], False) == ParsedOutput("")
    # Whitespace after a block of calls waits: it is layout unless text follows.
    closed = f'{MB}<invoke name="get_time"></invoke>{ME}'
    assert minimax.parse(closed + "\n", False) == ParsedOutput("", [ParsedCall("get_time", "{}")])
    assert minimax.parse(closed + "\nDone", False).content == "\nDone"


@pytest.mark.parametrize(
    ("parser", "text"),
    [("glm45", text) for text in GLM45_TEXTS]
    + [("kimi_k2", text) for text in KIMI_K2_TEXTS]
    + [("minimax_m2", text) for text in MINIMAX_M2_TEXTS],
)
def test_a_stream_adds_up_however_it_is_cut(parser, text):
    """In two pieces split at every point (a marker in two chunks, or a whole block in one):
    the content and calls add up to the whole answer."""
    reader = calling("auto", parser)
    parsed = reader.parse(text, final=True)
    want = (parsed.content, [{"name": c.name, "arguments": c.arguments} for c in parsed.calls])
    for cut in range(len(text)):
        stream = ToolCallStream(reader)
        content, calls = "", []
        for end in (cut, len(text)):
            new_content, deltas = stream.feed(text[:end], final=end == len(text))
            content += new_content
            for delta in deltas:
                if delta.index == len(calls):
                    calls.append({"name": delta.name, "arguments": ""})
                calls[delta.index]["arguments"] += delta.arguments
        assert (content, calls) == want


CASES = (
    [("auto", "hermes", text) for text in HERMES_TEXTS]
    + [("auto", "llama3_json", text) for text in LLAMA_TEXTS]
    + [("auto", "pythonic", text) for text in PYTHONIC_TEXTS]
    + [("auto", "mistral", text) for text in MISTRAL_TEXTS]
    + [("auto", "qwen3_coder", text) for text in QWEN3_CODER_TEXTS]
    + [("auto", "seed_oss", text) for text in SEED_OSS_TEXTS]
    + [("auto", "deepseek_v3", text) for text in DEEPSEEK_V3_TEXTS]
    + [("auto", "deepseek_v31", text) for text in DEEPSEEK_V31_TEXTS]
    + [("auto", "glm45", text) for text in GLM45_TEXTS]
    + [("auto", "kimi_k2", text) for text in KIMI_K2_TEXTS]
    + [("auto", "minimax_m2", text) for text in MINIMAX_M2_TEXTS]
    + [("auto", "granite", text) for text in GRANITE_TEXTS]
    + [("auto", "phi4_mini_json", text) for text in PHI4_MINI_TEXTS]
    + [("required", None, text) for text in REQUIRED_TEXTS]
    + [({"type": "function", "function": {"name": "get_weather"}}, None, '{"city": "Oslo"}')]
    + [("none", None, HERMES_TEXTS[2])]
)


@pytest.mark.parametrize(("tool_choice", "parser", "text"), CASES)
def test_a_stream_adds_up_to_the_whole_answer(tool_choice, parser, text):
    """Fed a character at a time, each partial reading only extends the last, and the
    deltas join into the whole answer's content and calls."""
    reader = calling(tool_choice, parser)
    parsed = reader.parse(text, final=True)
    stream = ToolCallStream(reader)
    content, calls, ids = "", [], []
    for end in range(1, len(text) + 1):
        new_content, deltas = stream.feed(text[:end], final=end == len(text))
        content += new_content
        for delta in deltas:
            if delta.index == len(calls):
                # The model's id where its format writes one (Kimi K2's), else a new one.
                model_id = parsed.calls[delta.index].id
                assert delta.id == model_id if model_id else delta.id.startswith("call_")
                assert delta.name is not None
                calls.append({"name": delta.name, "arguments": ""})
                ids.append(delta.id)
            else:
                assert delta.id is None and delta.name is None
            calls[delta.index]["arguments"] += delta.arguments
    assert content == parsed.content
    assert calls == [{"name": c.name, "arguments": c.arguments} for c in parsed.calls]
    assert len(set(ids)) == len(ids)
    assert stream.finish_reason("stop") == reader.finish_reason("stop", parsed)
    if not parsed.calls:
        assert content == text


# gpt-oss (harmony): the generation prompt ends "<|start|>assistant", the output opens with
# a header; <|call|> and <|return|> end the generation, so they are seldom in the text.
THINK = "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant"
OPENAI_TEXTS = [
    # The recipient after the channel ...
    THINK + "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city":"Paris"}<|call|>',
    # ... or before it, in the role's part of the header.
    THINK + ' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Rome"}',
    # A preamble for the user, then two calls.
    THINK + "<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
    "<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}",
    THINK + "<|channel|>final<|message|>It is sunny.<|return|>",
    # Cut off while thinking; and inside a call's arguments (the call as written).
    "<|channel|>analysis<|message|>Maybe <|start|> is",
    THINK + '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Os',
    # A built-in tool's call (not a function) is neither content nor a call.
    THINK + "<|channel|>analysis to=browser.search code<|message|>{}<|end|><|start|>assistant"
    "<|channel|>final<|message|>Found.",
    # Not harmony (bare text): content.
    "Plain text.",
]


def test_openai_reads_harmony_calls_and_leaves_the_thinking_out():
    """vLLM's ``openai`` parser: calls are messages to=functions.NAME in either place of the
    header, content the final channel and preambles; the analysis channel is not content
    even without a reasoning parser."""
    openai = calling("auto", "openai")
    expected = [
        ParsedOutput("", [ParsedCall("get_weather", '{"city":"Paris"}')]),
        ParsedOutput("", [ParsedCall("get_weather", '{"city":"Rome"}')]),
        ParsedOutput(
            "Checking both.",
            [ParsedCall("get_weather", '{"city":"Oslo"}'), ParsedCall("get_time", "{}")],
        ),
        ParsedOutput("It is sunny."),
        ParsedOutput(""),
        ParsedOutput("", [ParsedCall("get_weather", '{"city": "Os')]),
        ParsedOutput("Found."),
        ParsedOutput("Plain text."),
    ]
    assert [openai.parse(text, True) for text in OPENAI_TEXTS] == expected
    assert openai.reads_whole_output and not calling("auto", "hermes").reads_whole_output
    assert "<|channel|>" in openai.markers and "<|constrain|>" in openai.markers
    single = calling("auto", "openai", parallel=False)
    assert [call.name for call in single.parse(OPENAI_TEXTS[2], True).calls] == ["get_weather"]
    # While streaming: a call counts once its header is written, its arguments grow, and
    # what may begin a marker is held back.
    assert openai.parse(THINK + " to=functions.get_wea", False) == ParsedOutput("")
    open_call = THINK + " to=functions.get_weather<|channel|>commentary json<|message|>"
    assert openai.parse(open_call + '{"city":<|ca', False) == ParsedOutput(
        "", [ParsedCall("get_weather", '{"city":')]
    )


@pytest.mark.parametrize("text", OPENAI_TEXTS)
def test_an_openai_stream_adds_up_to_the_whole_answer_however_it_is_cut(text):
    """Fed a character at a time (every marker in pieces), and in two pieces split at
    every point: the content and the calls' deltas add up to the whole answer."""
    reader = calling("auto", "openai")
    parsed = reader.parse(text, final=True)
    want = (parsed.content, [{"name": c.name, "arguments": c.arguments} for c in parsed.calls])
    cuts = [list(range(1, len(text) + 1))] + [[cut, len(text)] for cut in range(len(text))]
    for ends in cuts:
        stream = ToolCallStream(reader)
        content, calls = "", []
        for end in ends:
            new_content, deltas = stream.feed(text[:end], final=end == len(text))
            assert "<|" not in new_content
            content += new_content
            for delta in deltas:
                if delta.index == len(calls):
                    calls.append({"name": delta.name, "arguments": ""})
                assert "<|" not in delta.arguments
                calls[delta.index]["arguments"] += delta.arguments
        assert (content, calls) == want
        assert stream.finish_reason("stop") == reader.finish_reason("stop", parsed)


def test_finish_reason_says_tool_calls_when_the_model_chose_to_call():
    call = ParsedOutput("", [ParsedCall("get_time", "{}")])
    assert calling("auto", "hermes").finish_reason("stop", call) == "tool_calls"
    assert calling("required").finish_reason("stop", call) == "tool_calls"
    assert calling("required").finish_reason("length", call) == "length"
    assert calling("auto", "hermes").finish_reason("stop", ParsedOutput("hi")) == "stop"
    named = calling({"type": "function", "function": {"name": "get_time"}})
    assert named.finish_reason("stop", call) == "stop"  # as OpenAI ends a forced call


def test_tool_messages_reach_the_template_with_arguments_as_objects():
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    }  # fmt: skip
    assert chat_message_tool_fields(assistant, "messages[1]") == {
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                "id": "call_1",
            }
        ]
    }
    result = {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    assert chat_message_tool_fields(result, "messages[2]") == {"tool_call_id": "call_1"}

    def field(message) -> str:
        with pytest.raises(ToolCallError) as caught:
            chat_message_tool_fields(message, "messages[1]")
        return caught.value.field

    assert field({"role": "tool", "content": "x"}) == "messages[1].tool_call_id"
    bad_arguments = json.loads(json.dumps(assistant))
    bad_arguments["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    assert field(bad_arguments) == "messages[1].tool_calls[0].function.arguments"
    assert field({"role": "user", "tool_calls": []}) == "messages[1].tool_calls"
    assert field({"role": "assistant", "tool_calls": [{"x": 1}]}) == "messages[1].tool_calls[0]"
