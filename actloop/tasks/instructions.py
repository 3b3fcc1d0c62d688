"""Verifiable instruction following (IFEval style), generated under a seed.

A prompt is a short writing task about a topic plus 1-3 constraints drawn from a pool of
templates, e.g. "Write a short note about trains. Do not use any commas. End your response
with the exact phrase "That is all."". Constraints that cannot hold together (lowercase and
capital letters; quotation marks around everything and a required first phrase; lowercase and
a "P.S.") are never drawn together, and `gold_response` writes an answer that meets every
constraint, so each generated row is known to be satisfiable.

Held-out prompts carry constraint combinations that no training prompt has (`make_splits`).

Reward: the instructions grader (`actloop.rewards.instructions`): the fraction of constraints
met, zeroed when the answer does not do the writing task at all (`off_task`: too short, or never
mentions the topic) — IFEval's *loose* (here: per-constraint) accuracy is the mean reward; an empty answer
scores 0. `success` = all met, IFEval's *strict* (per-prompt) accuracy.
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable

from actloop.envs.prompted import PromptEnv, qa_shots
from actloop.rewards.flags import Flag
from actloop.rewards.instructions import instructions_reward, words
from actloop.rewards.rubric import RewardTerm
from actloop.tasks.base import Task

TOPICS = ["the ocean", "a rainy day", "learning to cook", "a city park", "the moon", "a summer holiday", "trains",
          "a small garden", "winter mornings", "a library", "music", "friendship", "a mountain hike", "coffee",
          "bicycles", "the night sky", "a busy market", "old photographs", "a first job", "snow", "the desert",
          "a long walk", "birds", "a school trip", "board games", "a quiet village", "the river", "tea"]
TASKS = ["Write a short note about {topic}.", "Describe {topic} in a few lines.",
         "Write a short message to a friend about {topic}.", "Share a few thoughts about {topic}."]
START_PHRASES = ["Here is my answer", "Sure", "Dear reader"]
END_PHRASES = ["Is there anything else I can help with?", "That is all.", "Thank you for reading."]
REQUIRED = ["bright", "quiet", "simple", "green", "gentle", "happy", "warm", "clear", "calm", "golden"]
FORBIDDEN = ["very", "really", "thing", "stuff", "basically"]

Spec = dict[str, Any]
# name -> (draw (rng) -> (instruction text, spec), names it cannot be drawn with)
POOL: dict[str, tuple[Callable[[random.Random], tuple[str, Spec]], set[str]]] = {
    "word_count": (lambda r: (lambda n: (f"Use at most {n} words.", {"type": "word_count", "max": n}))(
        r.choice([50, 60, 80])), set()),
    "no_commas": (lambda r: ("Do not use any commas.", {"type": "no_commas"}), set()),
    "lowercase": (lambda r: ("Write everything in lowercase letters.", {"type": "lowercase"}),
                  {"uppercase", "postscript"}),
    "uppercase": (lambda r: ("Write everything in capital letters.", {"type": "uppercase"}), {"lowercase"}),
    "ends_with": (lambda r: (lambda p: (f'End your response with the exact phrase "{p}".',
                                        {"type": "ends_with", "phrase": p}))(r.choice(END_PHRASES)), set()),
    "starts_with": (lambda r: (lambda p: (f'Start your response with "{p}".', {"type": "starts_with", "phrase": p}))(
        r.choice(START_PHRASES)), {"quotation"}),
    "required_words": (lambda r: (lambda ws: (f'Include the words "{ws[0]}" and "{ws[1]}".',
                                              {"type": "required_words", "words": ws}))(r.sample(REQUIRED, 2)), set()),
    "keyword_frequency": (lambda r: (lambda w: (f'Use the word "{w}" at least 3 times.',
                                                {"type": "keyword_frequency", "word": w, "min": 3}))(
        r.choice(REQUIRED)), set()),
    "forbidden_words": (lambda r: (lambda w: (f'Do not use the word "{w}".', {"type": "forbidden_words", "words": [w]}))(
        r.choice(FORBIDDEN)), set()),
    "bullet_count": (lambda r: (lambda n: (f'Use exactly {n} bullet points, each on a line starting with "- ".',
                                           {"type": "bullet_count", "n": n}))(r.randint(2, 4)), set()),
    "title": (lambda r: ("Give your response a title in double angular brackets, like <<my title>>.",
                         {"type": "title"}), set()),
    "postscript": (lambda r: ("Add a postscript starting with P.S.", {"type": "postscript", "marker": "P.S."}),
                   {"lowercase"}),
    "quotation": (lambda r: ("Wrap your entire response in double quotation marks.", {"type": "quotation"}),
                  {"starts_with"}),
}


def make_problem(rng: random.Random) -> dict[str, Any]:
    """One prompt: a task about a topic and 1-3 compatible constraints."""
    topic = rng.choice(TOPICS)
    k = rng.choice([1, 2, 2, 3])
    names: list[str] = []
    for name in rng.sample(sorted(POOL), len(POOL)):
        if len(names) == k:
            break
        if any(name in POOL[n][1] or n in POOL[name][1] for n in names):
            continue
        names.append(name)
    texts, specs = zip(*(POOL[n][0](rng) for n in names))
    instruction = rng.choice(TASKS).format(topic=topic) + " " + " ".join(texts)
    return {"instruction": instruction, "topic": topic, "constraints": list(specs)}


def gold_response(topic: str, constraints: list[Spec]) -> str:
    """An answer that meets every constraint (for validation and worked examples)."""
    by = {c["type"]: c for c in constraints}
    parts: list[str] = []
    if "starts_with" in by:
        parts.append(by["starts_with"]["phrase"])
    if "title" in by:
        parts.append("<<Notes>>")
    body = f"Here are my notes about {topic}. I think about it often and enjoy it."
    if "required_words" in by:
        body += " It feels " + " and ".join(by["required_words"]["words"]) + "."
    if "keyword_frequency" in by:
        w = by["keyword_frequency"]["word"]
        body += f" {w.capitalize()} light and {w} air make a {w} day."
    parts.append(body)
    for i in range(by.get("bullet_count", {}).get("n", 0)):
        parts.append(f"- Point {i + 1} about it")
    if "postscript" in by:
        parts.append("P.S. Write back soon.")
    if "ends_with" in by:
        parts.append(by["ends_with"]["phrase"])
    text = "\n".join(parts)
    if "lowercase" in by:
        text = text.lower()
    if "uppercase" in by:
        text = text.upper()
    if "quotation" in by:
        text = f'"{text}"'
    return text


def combination(row: dict[str, Any]) -> str:
    """The row's constraint combination, e.g. `no_commas+title` (types sorted, values ignored)."""
    return "+".join(sorted(c["type"] for c in row["constraints"]))


def make_splits(train_size: int, eval_size: int, seed: int, split: str = "test") -> tuple[list[dict], list[dict]]:
    """Disjoint training and held-out prompts (`split`: `test` or `validation`, drawn from their
    own streams). The held-out set tests generalisation, not recall: no training row has the
    *combination* of constraint types of any held-out row (a held-out `no_commas+title` means no
    training prompt asks for exactly those two), so every held-out prompt is a combination the
    policy never trained on, made of constraints it trained on in other company."""
    held_rng, train_rng = random.Random(f"ifeval-{split}-{seed}"), random.Random(f"ifeval-train-{seed}")
    held: dict[str, dict] = {}
    for _ in range(50 * eval_size + 100):
        if len(held) >= eval_size:
            break
        p = make_problem(held_rng)
        held.setdefault(p["instruction"], p)
    unseen = {combination(p) for p in held.values()}
    train: dict[str, dict] = {}
    for _ in range(50 * train_size + 100):
        if len(train) >= train_size:
            break
        p = make_problem(train_rng)
        if combination(p) not in unseen:
            train.setdefault(p["instruction"], p)
    return list(train.values()), list(held.values())


_SHOT_PROBLEMS = [
    ("Write a short note about a red kite. Do not use any commas. Use exactly 2 bullet points, each on a line "
     'starting with "- ".', "a red kite", [{"type": "no_commas"}, {"type": "bullet_count", "n": 2}]),
    ('Describe a sunny beach in a few lines. Start your response with "Sure". Write everything in lowercase letters.',
     "a sunny beach", [{"type": "starts_with", "phrase": "Sure"}, {"type": "lowercase"}]),
]
SHOTS = qa_shots([(q, gold_response(t, c)) for q, t, c in _SHOT_PROBLEMS])

MIN_WORDS = 12  # the shortest gold answer has 13; any honest note of "a few lines" has more


def off_task(text: str, row: dict[str, Any]) -> list[Flag]:
    """Hack detector: an answer that does not do the writing task — fewer than MIN_WORDS words, or
    no mention of the topic's head noun (`a school trip` -> `trip`, plurals too). Constraints alone
    are met by replies that write nothing: "sure" satisfies "no commas" and "lowercase", echoing
    "That is all." satisfies the ending. Measured: a GRPO run rewarded without this check took
    strict accuracy from 16% to 45%, and all 45 successes were such replies ("sure", "golden and
    green", "P.S."). Flagged `off_task`; the rubric's default policy zeroes the reward. Only rows
    with a `topic` (the generated ones) are checked."""
    topic = str(row.get("topic") or "").split()
    if not topic:  # rows of your own (IFEval's form) are graded by their constraints alone
        return []
    n = len(words(text))
    if n < MIN_WORDS:
        return [Flag("off_task", f"{n} words; the task asks for a note of a few lines (>= {MIN_WORDS} words)")]
    head = topic[-1].lower()
    stem = head[:-1] if head.endswith("s") and len(head) > 3 else head
    if not re.search(rf"\b{re.escape(stem)}", text, re.I):
        return [Flag("off_task", f"never mentions the topic ({' '.join(topic)})")]
    return []
SYSTEM = "Follow every instruction in the request exactly."


def env() -> PromptEnv:
    return PromptEnv(SYSTEM, SHOTS, lambda row: row["instruction"])


def gold_completion(row: dict[str, Any]) -> str:
    return gold_response(row["topic"], row["constraints"])


TASK = Task(
    name="instructions",
    env=env,
    rewards=[RewardTerm("instructions", instructions_reward())],
    detectors=(off_task,),
    splits=make_splits,
    success="instructions",
    gold=gold_completion,
    description="a writing task with 1-3 verifiable constraints (generated, IFEval-style)",
)
