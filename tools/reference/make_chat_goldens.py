#!/usr/bin/env python3
"""Chat-format goldens for nibble's render_chat (src/text/chat.cc).

harmony: rendered by the openai_harmony package (pip install openai-harmony), which loads the
o200k_base ranks from TIKTOKEN_ENCODINGS_BASE; this script points that at the directory of the given
.tiktoken file so it runs offline. chatml: rendered with jinja2 from a Qwen3 chat template (the
"chat_template" of a Qwen3 tokenizer_config.json, saved as a .jinja file), in the environment that
transformers' apply_chat_template uses. The template is not committed; without it the chatml cases are
left out.

The OpenAI-message -> harmony-message mapping below is nibble's (mirrored in chat.cc): leading
system/developer messages become the developer message's instructions; assistant reasoning is an
analysis message, content a final message (a commentary preamble when there are tool calls); each tool
call is a commentary message to functions.NAME with content type <|constrain|>json; a tool result comes
from functions.NAME to the assistant. History rule: analysis messages before the last final message are
dropped (harmony's own auto_drop_analysis only drops those before the *first* final message, so it is
turned off and the rule is applied here).

usage: make_chat_goldens.py O200K_BASE.tiktoken OUT_DIR [QWEN3_TEMPLATE.jinja]
"""
import importlib.metadata
import json
import os
import sys

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the current weather.\nUse it for any place on Earth.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "description": "Forecast days", "default": 1},
                "hourly": {"type": "boolean"},
            },
            "required": ["city"],
        },
    },
}
RICH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the documentation.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "title": "Query", "examples": ["kv cache", "fp4"]},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["api", "design"]}},
                "limit": {"type": ["integer", "null"], "default": 10},
                "score": {"type": "number", "nullable": True},
                "filter": {
                    "type": "object",
                    "description": "Optional filter",
                    "properties": {"since": {"type": "string", "default": "2024-01-01"},
                                   "pages": {"type": "array", "items": {"type": "integer"}}},
                    "required": ["since"],
                },
                "mode": {"description": "How to match",
                         "oneOf": [{"type": "string", "description": "exact phrase"},
                                   {"type": "number", "description": "fuzzy threshold", "default": 0.5}]},
                "anything": {},
                "list": {"type": "array"},
            },
            "required": ["query", "mode"],
        },
    },
}
NO_ARGS_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current UTC time."}}
EMPTY_ARGS_TOOL = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


def call(id_, name, args):
    return {"id": id_, "name": name, "arguments": args}


CASES = [
    {"name": "user_only", "messages": [{"role": "user", "content": "Hello!"}]},
    {"name": "system_user_low_date", "options": {"reasoning_effort": "low", "current_date": "2025-08-05"},
     "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}]},
    {"name": "developer_high", "options": {"reasoning_effort": "high"},
     "messages": [{"role": "developer", "content": "Answer in French.\nBe brief."},
                  {"role": "user", "content": "Hi"}]},
    {"name": "two_leading_system", "messages": [{"role": "system", "content": "A."}, {"role": "developer", "content": "B."},
                                               {"role": "user", "content": "go"}]},
    {"name": "tools_weather", "options": {"tools": [WEATHER_TOOL]},
     "messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]},
    {"name": "tools_rich", "options": {"tools": [RICH_TOOL, NO_ARGS_TOOL, EMPTY_ARGS_TOOL]},
     "messages": [{"role": "user", "content": "find fp4 docs"}]},
    {"name": "history_drops_old_reasoning",
     "messages": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "reasoning": "User greets.", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "Tell me a joke."}]},
    {"name": "tool_loop_keeps_reasoning", "options": {"tools": [WEATHER_TOOL]},
     "messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "reasoning": "Need the weather tool.",
                   "tool_calls": [call("call_1", "get_weather", "{\"city\":\"Paris\"}")]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}]},
    {"name": "tool_loop_finished", "options": {"tools": [WEATHER_TOOL]},
     "messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "reasoning": "Need the tool.",
                   "tool_calls": [call("c1", "get_weather", "{\"city\":\"Paris\"}")]},
                  {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
                  {"role": "assistant", "reasoning": "Report it.", "content": "Sunny and 21C."},
                  {"role": "user", "content": "And Rome?"}]},
    {"name": "second_turn_tool_loop", "options": {"tools": [WEATHER_TOOL]},
     "messages": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "reasoning": "Greeting.", "content": "Hello!"},
                  {"role": "user", "content": "Weather in Oslo and Rome?"},
                  {"role": "assistant", "reasoning": "Two calls.", "content": "Checking both.",
                   "tool_calls": [call("a", "get_weather", "{\"city\":\"Oslo\"}"),
                                  call("b", "get_weather", "{\"city\":\"Rome\"}")]},
                  {"role": "tool", "tool_call_id": "a", "content": "cold"},
                  {"role": "tool", "name": "get_weather", "content": "warm"}]},
    {"name": "no_generation_prompt", "options": {"add_generation_prompt": False},
     "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
    {"name": "system_in_the_middle",
     "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                  {"role": "system", "content": "Now answer in German."}, {"role": "user", "content": "Thanks"}]},
    {"name": "unicode_and_specials_text",
     "messages": [{"role": "user", "content": "naïve café 東京 👩‍💻\n\ttabs  and <b>tags</b>"}]},
    {"name": "chatml_no_thinking", "options": {"enable_thinking": False},
     "messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]},
    {"name": "chatml_inline_think",
     "messages": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "<think>\nThey greet.\n</think>\n\nHello!"},
                  {"role": "user", "content": "Bye"},
                  {"role": "assistant", "content": "<think>\nThey leave.\n</think>\n\nBye!"}],
     "options": {"add_generation_prompt": False}},
]


def harmony_render(case, h):
    from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort,
                                RenderConversationConfig, Role, SystemContent, ToolDescription)
    opts = case.get("options", {})
    effort = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
    sys_content = SystemContent.new().with_reasoning_effort(effort[opts.get("reasoning_effort", "medium")])
    if opts.get("current_date"):
        sys_content = sys_content.with_conversation_start_date(opts["current_date"])
    out = [Message.from_role_and_content(Role.SYSTEM, sys_content)]
    messages = case["messages"]
    i, instructions = 0, []
    while i < len(messages) and messages[i]["role"] in ("system", "developer"):
        instructions.append(messages[i]["content"])
        i += 1
    tools = opts.get("tools", [])
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if tools:
            dev = dev.with_function_tools([
                ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                    parameters=t["function"].get("parameters")) for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    calls = {}
    for m in messages[i:]:
        role = m["role"]
        if role in ("system", "developer"):
            out.append(Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(m["content"])))
        elif role == "user":
            out.append(Message.from_role_and_content(Role.USER, m["content"]))
        elif role == "tool":
            name = calls.get(m.get("tool_call_id"), m.get("name"))
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), m["content"])
                       .with_channel("commentary").with_recipient("assistant"))
        else:
            if m.get("reasoning"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["reasoning"]).with_channel("analysis"))
            if not m.get("tool_calls"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, m.get("content", "")).with_channel("final"))
                continue
            if m.get("content"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel("commentary"))
            for c in m["tool_calls"]:
                calls[c["id"]] = c["name"]
                out.append(Message.from_role_and_content(Role.ASSISTANT, c["arguments"]).with_channel("commentary")
                           .with_recipient(f"functions.{c['name']}").with_content_type("<|constrain|>json"))
    finals = [k for k, msg in enumerate(out) if msg.channel == "final"]
    if finals:
        out = [msg for k, msg in enumerate(out) if not (k < finals[-1] and msg.channel == "analysis")]
    convo = Conversation.from_messages(out)
    config = RenderConversationConfig(auto_drop_analysis=False)
    if opts.get("add_generation_prompt", True):
        tokens = h.render_conversation_for_completion(convo, Role.ASSISTANT, config)
    else:
        tokens = h.render_conversation(convo, config)
    return h.decode_utf8(tokens)


def chatml_render(case, template):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    opts = case.get("options", {})
    messages = []
    for m in case["messages"]:
        out = {"role": "system" if m["role"] == "developer" else m["role"], "content": m.get("content", "")}
        if m.get("reasoning"):
            out["reasoning_content"] = m["reasoning"]
        if m.get("tool_calls"):
            out["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
        for k in ("tool_call_id", "name"):
            if m.get(k):
                out[k] = m[k]
        messages.append(out)
    kwargs = {"messages": messages, "add_generation_prompt": opts.get("add_generation_prompt", True),
              "enable_thinking": opts.get("enable_thinking", True)}
    if opts.get("tools"):
        kwargs["tools"] = opts["tools"]
    return env.from_string(template).render(**kwargs)


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    tiktoken_path, out_dir = sys.argv[1], sys.argv[2]
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = os.path.dirname(os.path.abspath(tiktoken_path))
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    import openai_harmony
    h = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    template = None
    if len(sys.argv) == 4:
        with open(sys.argv[3], encoding="utf-8") as f:
            template = f.read()
    goldens = []
    for case in CASES:
        options = dict(case.get("options", {}))
        tools = options.pop("tools", None)
        if tools:
            options["tools_json"] = json.dumps(tools)
        entry = {"name": case["name"], "messages": case["messages"], "options": options, "expected": {}}
        if not case["name"].startswith("chatml_"):
            entry["expected"]["harmony"] = harmony_render(case, h)
        if template is not None:
            entry["expected"]["chatml"] = chatml_render(case, template)
        goldens.append(entry)
    versions = {"openai_harmony": importlib.metadata.version("openai-harmony")}
    try:
        import jinja2
        versions["jinja2"] = jinja2.__version__
    except ImportError:
        pass
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "chat_goldens.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"generator": "tools/reference/make_chat_goldens.py", "versions": versions,
                   "chatml_template": "Qwen3 (Qwen/Qwen3-0.6B chat_template)" if template else None,
                   "cases": goldens}, f, ensure_ascii=True, indent=1)
        f.write("\n")
    print(f"wrote {path}: {len(goldens)} cases")


if __name__ == "__main__":
    main()
