"""How a question is shown to the policy and how its answer is written.

Without a chat template a task's question is shown as (``PROMPT_TEMPLATE``)::

    Question: What is 37 + 48?
    Answer:

and the completion must end its reasoning with the final answer on a line of its own,
GSM8K style (``" 37 + 48 = 85.\\n#### 85"``). The answer marker is ``####`` followed by a
number; the rewards (``tasks.rewards``) read the number after the *first*
marker. With a chat template the user message is the question and the task's instruction
(``INSTRUCTION`` for numeric answers; ``PromptRenderer``
renders it).
"""

from __future__ import annotations

from collections.abc import Sequence

ANSWER_MARKER = "####"
PROMPT_TEMPLATE = "Question: {prompt}\nAnswer:"
INSTRUCTION = (
    f'Think step by step, then give the final answer on its own line as "{ANSWER_MARKER} <number>".'
)


def format_prompt(prompt: str, template: str = PROMPT_TEMPLATE) -> str:
    """The text the policy is conditioned on for question ``prompt`` (no chat template)."""
    return template.format(prompt=prompt)


def format_answer(answer: str) -> str:
    """The final-answer line, ``"#### <answer>"``."""
    return f"{ANSWER_MARKER} {answer}"


def format_completion(answer: str, solution: str | None = None) -> str:
    """A reference completion: ``" <solution>\\n#### <answer>"`` (for tokenizer corpora,
    SFT warm-up and tests)."""
    return (f" {solution}\n" if solution else " ") + format_answer(answer)


def task_texts(tasks: Sequence[dict]) -> list[str]:
    """Prompt + reference completion of each task, e.g. to train a tokenizer on."""
    return [
        format_prompt(t["prompt"])
        + format_completion(t["answer"], t.get("metadata", {}).get("solution"))
        for t in tasks
    ]
