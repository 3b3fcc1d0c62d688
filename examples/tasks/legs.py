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
    (a, x), (b, y) = row["animals"]
    return f"How many legs do {a} {x}s and {b} {y}s have in total?"


SHOTS = qa_shots([
    (question({"animals": [[2, "horse"], [3, "duck"]]}), "2 horses have 2 * 4 = 8 legs, 3 ducks 3 * 2 = 6.\n#### 14"),
    (question({"animals": [[1, "crab"], [4, "frog"]]}), "1 crab has 10 legs, 4 frogs 4 * 4 = 16.\n#### 26"),
])


def make_env():
    return PromptEnv("Answer the question. End with #### N.", SHOTS, question)


def splits(train_size, eval_size, seed, split):
    def draw(rng):
        x, y = rng.sample(sorted(LEGS), 2)
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return {"animals": [[a, x], [b, y]], "answer": a * LEGS[x] + b * LEGS[y]}

    held = [draw(random.Random(f"{split}-{seed}-{i}")) for i in range(eval_size)]
    keys = {str(r["animals"]) for r in held}
    rng = random.Random(f"train-{seed}")
    train = [r for r in (draw(rng) for _ in range(3 * train_size + 10)) if str(r["animals"]) not in keys]
    return train[:train_size], held


def mentions_answer(prompts, completions, answer, **kwargs):
    """TRL-style: 1.0 when the right number appears anywhere in the reply."""
    return [float(str(a) in c) for c, a in zip(completions, answer)]


def too_long(completion, row):
    """A detector: (completion, row) -> flags. It reads the text; it never runs it."""
    return [Flag("too_long", f"{len(completion)} characters")] if len(completion) > 400 else []


TASK = Task(name="legs", env=make_env, rewards=[mentions_answer], detectors=[*MATH_DETECTORS, too_long],
            policies={"too_long": "log"}, splits=splits, gold=lambda row: f"#### {row['answer']}",
            description="add up animal legs (a naive TRL-style reward and hack detectors)")
