"""Count letters with a tool: a multi-turn task the embedded model learns to call.

    actloop train data.task=examples/tasks/letter_count.py:TASK
    actloop eval --task examples/tasks/letter_count.py:TASK
    actloop grade --task examples/tasks/letter_count.py:TASK --id 0 --completion answer.txt
"""
import random
import re

from actloop import Message, RewardTerm, Task, ToolCall, ToolEnv, tool

WORDS = ["strawberry", "banana", "mississippi", "bookkeeper", "committee", "parallel", "balloon", "coffee",
         "address", "assessment", "happiness", "tomorrow", "necessary", "occurrence", "possession", "millennium"]
SYSTEM = "Count letters with the count_letter tool, then reply: The answer is N."


def question(row):
    return f'How many times does the letter "{row["letter"]}" appear in "{row["word"]}"?'


def shot(word, letter):  # a worked example: small models copy what they are shown
    call = ToolCall("count_letter", {"word": word, "letter": letter})
    return [Message("user", question({"word": word, "letter": letter})), Message("assistant", "", tool_calls=(call,)),
            Message("tool", str(word.count(letter)), name="count_letter"),
            Message("assistant", f"The answer is {word.count(letter)}.")]


class LetterEnv(ToolEnv):
    def prompt(self, row):
        return [Message("system", SYSTEM), *shot("cherry", "r"), *shot("kayak", "k"), Message("user", question(row))]

    @tool
    def count_letter(self, word: str, letter: str) -> int:
        """Count how often a letter appears in a word.

        Args:
            word: the word to look in
            letter: the letter to count
        """
        return word.lower().count(letter.lower())


def splits(train_size, eval_size, seed, split):
    pairs = sorted({(w, c) for w in WORDS for c in w})
    random.Random(f"{split}-{seed}").shuffle(pairs)
    k, rng = min(eval_size, len(pairs) // 3), random.Random(f"train-{seed}")  # held-out pairs never in training
    rows = [{"word": w, "letter": c, "answer": w.count(c)} for w, c in pairs]
    return [rng.choice(rows[k:]) for _ in range(train_size)], rows[:k]


def correct(prompts, completions, answer, trajectories, **kwargs):
    """1.0 when the final reply (not a tool call) ends with the right count."""
    found = [re.findall(r"\d+", c) for c in completions]
    return [float(bool(f) and int(f[-1]) == a and not (t.turns and t.turns[-1].message.tool_calls))
            for f, a, t in zip(found, answer, trajectories)]


def used_tool(prompts, completions, trajectories, **kwargs):
    return [float(t.num_tool_calls > 0) for t in trajectories]


TASK = Task(name="letter_count", env=LetterEnv, rewards=[correct, RewardTerm("used_tool", used_tool, 0.0)],
            splits=splits, success="correct", gold=lambda row: f"The answer is {row['answer']}.",
            description="count a letter in a word with a count_letter tool")
