"""The canonical conversation's shapes: plain dicts at runtime, crossings without copies."""

from capture_proxy.core.conversation import ChatMessage, kept_messages, open_dict, tool_call
from capture_proxy.core.fronts.messages import MessagesCodec


def test_a_tool_call_is_the_chat_shape():
    assert tool_call("call_1", "bash", '{"cmd": "ls"}') == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "bash", "arguments": '{"cmd": "ls"}'},
    }


def test_open_dict_is_the_same_object_and_kept_messages_are_copies():
    message: ChatMessage = {"role": "user", "content": "hi"}
    assert open_dict(message) is message
    stored = [{"role": "assistant", "content": None, "tool_calls": []}]
    kept = kept_messages(stored)
    assert kept == stored
    assert kept[0] is not stored[0]


def test_a_parsed_request_holds_plain_dicts():
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    chat = MessagesCodec().parse(body).chat
    assert type(chat) is dict
    assert chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
    }
