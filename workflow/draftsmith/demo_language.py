"""The embedded demo's synthetic language: its examples, its tokenizer and chat template, and
the question file the demo ships.

A low-entropy question -> answer language (counting, skip-counting, spelling, repeating):
a target trained on it answers predictably, so a drafter can learn it and the demo's
acceptance length measures the pipeline rather than noise. The assistant turn is
`<think> reasoning </think> answer </s>`, as with the production reasoning models.
``demo_model`` trains the targets on it.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# ---------------------------------------------------------------------------------------------
# The synthetic language
# ---------------------------------------------------------------------------------------------

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Ids are fixed by this order (UNK first so unknown words map to 0).
CONTROL_TOKENS = [UNK, BOS, EOS, PAD, SYSTEM, USER, ASSISTANT]
# The think tags are added tokens but not "special": like DeepSeek/Kimi, they must survive
# skip_special_tokens, so the reasoning wrapper stays in served text and re-rendered chats.
THINK_TOKENS = [THINK_OPEN, THINK_CLOSE]

NUMBERS = [str(i) for i in range(100)]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
WORDS = (
    "apple house river green table water light stone bread cloud music tiger horse plant "
    "chair paper sugar lemon ocean mouse smile train queen zebra pizza jump fish bird moon "
    "star tree book cat dog sun red blue hat cup box key map egg owl fox cake milk rain snow "
    "wind king ship door road gold ring lamp rose frog bear"
).split()
FUNCTION_WORDS = (
    "count from to down up backwards spell the word write letter by repeat say times list "
    "numbers start at go one stop has letters you are a helpful assistant answer briefly please"
).split()
SYSTEM_PROMPTS = ["you are a helpful assistant", "answer briefly", "you answer briefly"]
# Reversing a list was tried and dropped: a 1-minute model on 2 cores did not learn it.
TASKS = ("count_up", "count_down", "count_by", "spell", "repeat")


@dataclass(frozen=True)
class Example:
    """One question with its deterministic reasoning and answer (space-separated words)."""

    task: str
    question: str
    reasoning: str
    answer: str

    @property
    def assistant_content(self) -> str:
        return f"{THINK_OPEN} {self.reasoning} {THINK_CLOSE} {self.answer}"


def vocabulary() -> list[str]:
    """All tokens, control tokens first; a word appears once even if it is also a letter."""
    seen: dict[str, None] = {}
    for token in CONTROL_TOKENS + THINK_TOKENS + NUMBERS + LETTERS + WORDS + FUNCTION_WORDS:
        seen.setdefault(token, None)
    return list(seen)


def make_example(rng: random.Random, task: str | None = None) -> Example:
    """Draw one example; the answer is a pure function of the question."""
    task = task or rng.choice(TASKS)
    if task in ("count_up", "count_down"):
        length = rng.randint(3, 12)
        low = rng.randint(0, 100 - length)
        high = low + length - 1
        numbers = [str(i) for i in range(low, high + 1)]
        if task == "count_up":
            question = rng.choice(
                [
                    f"count from {low} to {high}",
                    f"please count from {low} to {high}",
                    f"list the numbers from {low} to {high}",
                ]
            )
            return Example(task, question, f"start at {low} go up by one stop at {high}", " ".join(numbers))
        question = rng.choice([f"count down from {high} to {low}", f"count backwards from {high} to {low}"])
        return Example(task, question, f"start at {high} go down by one stop at {low}", " ".join(reversed(numbers)))
    if task == "count_by":
        step = rng.choice([2, 3, 5])
        length = rng.randint(3, 8)
        low = rng.randint(0, 99 - step * (length - 1))
        high = low + step * (length - 1)
        question = rng.choice([f"count from {low} to {high} by {step}", f"count up from {low} to {high} by {step}"])
        return Example(
            task,
            question,
            f"start at {low} go up by {step} stop at {high}",
            " ".join(str(i) for i in range(low, high + 1, step)),
        )
    if task == "spell":
        word = rng.choice(WORDS)
        question = rng.choice([f"spell the word {word}", f"spell {word}", f"write {word} letter by letter"])
        return Example(task, question, f"the word {word} has {len(word)} letters", " ".join(word))
    if task == "repeat":
        phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2)))
        times = rng.randint(2, 5)
        question = rng.choice([f"repeat {phrase} {times} times", f"say {phrase} {times} times"])
        return Example(task, question, f"say {phrase} {times} times", " ".join([phrase] * times))
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def example_messages(example: Example, system: str | None = None) -> list[dict[str, str]]:
    """The example as a chat whose assistant turn carries the reasoning separately."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": example.question})
    messages.append({"role": "assistant", "content": example.answer, "reasoning_content": example.reasoning})
    return messages


# ---------------------------------------------------------------------------------------------
# Tokenizer and chat template
# ---------------------------------------------------------------------------------------------

# The generation prompt ends at the assistant marker so the model emits `<think>` itself.
# Reasoning given as `reasoning_content` or `reasoning` (vLLM's field names) is re-wrapped in
# think tags: dropping it was the seed's chat-template bug. Content that already carries the
# tags is kept as is. Whitespace only separates words; the tokenizer splits on it.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ '<|system|> ' + message['content'] | trim + ' ' }}"
    "{%- elif message['role'] == 'user' -%}"
    "{{ '<|user|> ' + message['content'] | trim + ' ' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- set content = (message['content'] or '') | trim -%}"
    "{%- set reasoning = '' -%}"
    "{%- if message['reasoning_content'] is defined and message['reasoning_content'] -%}"
    "{%- set reasoning = message['reasoning_content'] | trim -%}"
    "{%- elif message['reasoning'] is defined and message['reasoning'] -%}"
    "{%- set reasoning = message['reasoning'] | trim -%}"
    "{%- endif -%}"
    "{{ '<|assistant|> ' }}"
    "{%- if reasoning and '<think>' not in content -%}"
    "{{ '<think> ' + reasoning + ' </think> ' }}"
    "{%- endif -%}"
    "{{ content + ' ' + eos_token + ' ' }}"
    "{%- else -%}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocabulary()`, with chat template and a readable decoder."""
    vocab = {token: i for i, token in enumerate(vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder joins tokens with spaces (none of ours start with "##"): decode
    # round-trips the words, and vLLM's incremental DecodeStream yields " word" per step.
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=512
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def render(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of a chat rendered by the tokenizer's own template."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------
# The shipped question file
# ---------------------------------------------------------------------------------------------


def question_rows(count: int = 1200, *, seed: int = 0, duplicates: int = 8) -> list[dict[str, Any]]:
    """`count` distinct questions in the three input shapes the questions stage accepts,
    plus `duplicates` exact copies of earlier rows (the stage must drop them)."""
    rng = random.Random(f"questions-{seed}")  # separate stream from the training data
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > 100 * count:
            raise ValueError(f"the synthetic language has fewer than {count} distinct questions")
        # Round-robin over tasks while they have fresh questions; small ones (spell) run out.
        task = TASKS[len(rows) % len(TASKS)] if attempts < 4 * count else None
        example = make_example(rng, task)
        if example.question in seen:
            continue
        seen.add(example.question)
        row_id = f"demo-{len(rows):04d}"
        shape = len(rows) % 10
        if shape == 7:
            rows.append({"id": row_id, "conversations": [{"from": "human", "value": example.question}]})
        elif shape == 8:
            rows.append({"id": row_id, "prompt": example.question})
        elif shape == 9 and len(rows) % 30 == 9:
            rows.append(
                {
                    "id": row_id,
                    "messages": [
                        {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                        {"role": "user", "content": example.question},
                    ],
                }
            )
        else:
            rows.append({"id": row_id, "messages": [{"role": "user", "content": example.question}]})
    for index in rng.sample(range(count), duplicates):
        rows.insert(rng.randint(index + 1, len(rows)), dict(rows[index]))
    return rows


def write_questions(path: Path, *, count: int = 1200, seed: int = 0, duplicates: int = 8) -> int:
    """Write the question JSONL atomically; returns the number of lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = question_rows(count, seed=seed, duplicates=duplicates)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, path)
    return len(rows)
