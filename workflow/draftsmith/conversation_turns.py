"""A conversation's requests, turn by turn: what generation and evaluation both send.

Turn ``i`` sends every earlier turn followed by the target's own answer to it, then the
messages turn ``i`` adds (the first also carries the system turns).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Chat = list[dict[str, str]]  # role/content messages, as sent to a chat completion


def first_prompt(messages: Sequence[Mapping[str, str]]) -> list[Mapping[str, str]]:
    """The messages up to and including the first user turn: what the first request sends."""
    first_user = next(i for i, message in enumerate(messages) if message["role"] == "user")
    return list(messages[: first_user + 1])


def turn_requests(messages: Chat) -> list[Chat]:
    """The messages each turn adds: the first with the system turns, each up to its user turn."""
    parts: list[Chat] = [[]]
    for message in messages:
        parts[-1].append(message)
        if message["role"] == "user":
            parts.append([])
    return parts[:-1]


def turn_messages(parts: list[Chat], answers: list[str]) -> Chat:
    """The request for turn ``len(answers)``: each earlier turn followed by the target's answer."""
    messages: Chat = []
    for part, answer in zip(parts, answers, strict=False):
        messages += [*part, {"role": "assistant", "content": answer}]
    return messages + parts[len(answers)]


def user_turns(messages: Sequence[Mapping[str, str]]) -> int:
    """How many turns the conversation asks: its user messages."""
    return sum(message["role"] == "user" for message in messages)
