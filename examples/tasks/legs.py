"""Count animal legs: a single-turn task whose rubric mixes a TRL-style reward function and a
hack detector.

    actloop train data.task=examples/tasks/legs.py:TASK
    actloop eval --task examples/tasks/legs.py:TASK
    actloop grade --task examples/tasks/legs.py:TASK --id 0 --completion answer.txt

The reward function is deliberately naive (the answer anywhere in the text earns full marks, as
in many blog-post rewards); the library's maths detector flags a reply that sprays or hedges
candidate answers, and the flag zeroes the reward (policy `zero`, the default). `too_long` is a
detector of our own, logged only (policy `log`).
"""
import random

from actloop import MATH_DETECTORS, Flag, PromptEnv, Task, qa_shots

LEGS = {"spider": 8, "cat": 4, "bird": 2, "ant": 6, "dog": 4, "chicken": 2, "beetle": 6, "octopus": 8}


def question(row):
    return f"A {row['animal']} has {row['legs']} legs. How many legs do {row['n']} {row['animal']}s have?"


SHOTS = qa_shots([
    (question({"animal": "horse", "legs": 4, "n": 3}), "3 horses have 3 * 4 = 12 legs.\n#### 12"),
    (question({"animal": "duck", "legs": 2, "n": 5}), "5 ducks have 5 * 2 = 10 legs.\n#### 10"),
])


def make_env():
    return PromptEnv("Answer the question. End with #### N.", SHOTS, question)


def splits(train_size, eval_size, seed, split):
    rows = [{"animal": a, "legs": legs, "n": n, "answer": n * legs} for a, legs in LEGS.items() for n in range(2, 30)]
    random.Random(f"{split}-{seed}").shuffle(rows)
    k, rng = min(eval_size, len(rows) // 3), random.Random(f"train-{seed}")  # held-out rows never in training
    return [rng.choice(rows[k:]) for _ in range(train_size)], rows[:k]


def mentions_answer(prompts, completions, answer, **kwargs):
    """TRL-style: 1.0 when the right number appears anywhere in the reply."""
    return [float(str(a) in c) for c, a in zip(completions, answer)]


def too_long(completion, row):
    """A detector: (completion, row) -> flags. It reads the text; it never runs it."""
    return [Flag("too_long", f"{len(completion)} characters")] if len(completion) > 400 else []


TASK = Task(name="legs", env=make_env, rewards=[mentions_answer], detectors=[*MATH_DETECTORS, too_long],
            policies={"too_long": "log"}, splits=splits, gold=lambda row: f"#### {row['answer']}",
            description="add up animal legs (a naive TRL-style reward and hack detectors)")
