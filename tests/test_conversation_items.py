"""A conversation's items as the model reads them (gateway/conversations.py `history`): messages by role,
client function calls and their outputs, and server tool calls as the call and the output recorded."""

from __future__ import annotations

import json

from gateway.conversations import history


def test_messages_and_function_calls_become_chat_turns():
    read = history(
        [
            {
                "id": "m1",
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be brief."}],
            },
            {
                "id": "m2",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather?"}],
            },
            {
                "id": "f1",
                "type": "function_call",
                "call_id": "c1",
                "name": "weather",
                "arguments": '{"city":"Oslo"}',
            },
            {
                "id": "f2",
                "type": "function_call",
                "call_id": "c2",
                "name": "weather",
                "arguments": '{"city":"Bergen"}',
            },
            {"id": "o1", "type": "function_call_output", "call_id": "c1", "output": "4 C"},
            {"id": "o2", "type": "function_call_output", "call_id": "c2", "output": "9 C"},
            {
                "id": "m3",
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Cold."}],
            },
        ],
        "t",
    )
    assert [m.role for m in read] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert [c.function.arguments for c in read[2].tool_calls] == ['{"city":"Oslo"}', '{"city":"Bergen"}']
    assert [(m.tool_call_id, m.content) for m in read[3:5]] == [("c1", "4 C"), ("c2", "9 C")]
    assert read[0].content == "Be brief." and read[-1].content == "Cold."


def test_server_tool_calls_are_read_as_the_call_and_its_recorded_output():
    read = history(
        [
            {
                "id": "ci_call9",
                "type": "code_interpreter_call",
                "status": "completed",
                "code": "print(6 * 7)",
                "container_id": "cntr_x",
                "outputs": [{"type": "logs", "logs": "42\n"}],
                "result": {"value": None, "files": [], "exit_code": 0, "truncated": False},
            },
            {
                "id": "fs_call10",
                "type": "file_search_call",
                "status": "completed",
                "queries": ["ferry"],
                "results": [{"file_id": "file-1", "text": "07:40"}],
            },
            {
                "id": "ws_call11",
                "type": "web_search_call",
                "status": "incomplete",
                "action": {"type": "open_page", "url": "https://example.org"},
            },
        ],
        "t",
    )
    call = read[0].tool_calls
    assert [(c.id, c.function.name) for c in call] == [
        ("call9", "code_interpreter"),
        ("call10", "file_search"),
        ("call11", "web_fetch"),
    ]
    assert json.loads(call[0].function.arguments) == {"code": "print(6 * 7)"}
    assert json.loads(call[2].function.arguments) == {"url": "https://example.org"}
    outputs = {m.tool_call_id: json.loads(m.content) for m in read[1:]}
    assert outputs["call9"]["stdout"] == "42\n" and outputs["call9"]["exit_code"] == 0
    assert outputs["call10"] == {"results": [{"file_id": "file-1", "text": "07:40"}]}
    assert "call11" not in outputs  # a call that never got its result: no output is invented
