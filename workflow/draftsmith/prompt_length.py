"""Prompt lengths in the target's tokens (chat template included), and which prompts fit.

A prompt fits when it leaves room for its answer: ``prompt + max_tokens <= server.max_model_len``.
vLLM refuses a prompt that fills the context only once the model has loaded (an hour for a
large target), and silently shortens the answer of one that leaves too little room; the
tokenizer tells both in seconds. So prompts are measured where they enter, and those that do
not fit are dropped and counted there: the questions stage at ``generation.max_tokens`` (or
the lower ``questions.max_prompt_tokens``), the evaluation sets and the held-out split at
``evaluation.max_tokens``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from draftsmith.run_config import RunConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = Iterable[Mapping[str, str]]


class PromptMeter:
    """Counts a conversation's prompt tokens as the server will: the target's chat template
    with the generation prompt appended."""

    def __init__(self, model: str, trust_remote_code: bool = False) -> None:
        # Imported here: the Snakefile imports the questions module, and every parse (each
        # dry run, each SLURM job) would pay transformers' 4 s import.
        from transformers import AutoTokenizer

        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            model, trust_remote_code=trust_remote_code
        )
        # Only counted, never fed to a model: no "longer than the maximum" warning per long prompt.
        self.tokenizer.model_max_length = sys.maxsize

    def tokens(self, messages: Messages) -> int:
        encoded = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return len(cast(dict[str, list[int]], encoded)["input_ids"])


@dataclass(frozen=True)
class PromptLimit:
    """The longest prompt a stage keeps, and the reason its summary counts the others under."""

    meter: PromptMeter
    max_tokens: int
    reason: str

    def fits(self, messages: Messages) -> bool:
        return self.meter.tokens(messages) <= self.max_tokens

    def answerable_turns(self, messages: Messages, answer_tokens: int) -> int:
        """How many leading user turns fit when every earlier answer is ``answer_tokens`` long:
        the worst case, for a conversation whose answers are not known yet (the evaluation
        sends the same turns to every server it compares). 0: not even the first."""
        conversation: list[Mapping[str, str]] = []
        answered = 0
        for message in messages:
            conversation.append(message)
            if message["role"] != "user":
                continue
            if self.meter.tokens(conversation) + answered * answer_tokens > self.max_tokens:
                break
            answered += 1
            conversation.append({"role": "assistant", "content": ""})  # its length is counted above
        return answered


def prompt_limit(settings: RunConfig, answer_key: str) -> PromptLimit:
    """The limit for prompts answered with up to ``answer_key`` tokens: ``generation.max_tokens``
    (the questions stage, where ``questions.max_prompt_tokens`` may lower it) or
    ``evaluation.max_tokens`` (the evaluation sets)."""
    training = answer_key == "generation.max_tokens"
    limit = settings.question_prompt_limit if training else settings.evaluation_prompt_limit
    answer = settings.generation.max_tokens if training else settings.evaluation.max_tokens
    context = settings.server.max_model_len
    if limit < context - answer:
        reason = f"prompt over questions.max_prompt_tokens {limit}"
    else:
        reason = f"prompt over {limit} tokens (no room for {answer_key} {answer} in server.max_model_len {context})"
    target = settings.target
    return PromptLimit(PromptMeter(target.model, target.trust_remote_code), limit, reason)
