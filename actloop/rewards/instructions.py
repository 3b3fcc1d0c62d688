"""Instruction following: verifiable constraints in the style of IFEval / IFBench.

A row carries its constraints, several per prompt, either as actloop specs

    {"constraints": [{"type": "word_count", "max": 50}, {"type": "forbidden_words", "words": ["very"]},
                     {"type": "ends_with", "phrase": "Any other questions?"}]}

or in IFEval's own form (`instruction_id_list` + `kwargs`), mapped onto the same checks:

    {"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
     "kwargs": [{}, {"relation": "less than", "num_words": 50}]}

Reward: the fraction of constraints satisfied (`mode="fraction"`) or 1.0 only when all are
(`mode="all"`). An empty answer scores 0 (it would satisfy "no commas" and "forbidden words"
vacuously) and is flagged `empty_response`. An unknown constraint type is an error, never a
silent pass: the rubric masks the batch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from actloop.rewards.base import RewardError
from actloop.rewards.flags import Flag, Grade

Check = Callable[[str, Mapping[str, Any]], tuple[bool, str]]

_WORD = re.compile(r"\b\w[\w'’-]*\b")


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+|\n\s*\n", text.strip())
    return [p for p in parts if re.search(r"\w", p)]


def paragraphs(text: str, separator: str | None = None) -> list[str]:
    parts = text.split(separator) if separator else re.split(r"\n\s*\n", text)
    return [p for p in parts if p.strip()]


def bullets(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.match(r"^\s*(?:[*-]|\d+[.)])\s+\S", ln) and not ln.strip().startswith("**")]


def _count_ok(n: int, spec: Mapping[str, Any], what: str) -> tuple[bool, str]:
    lo, hi, exact = spec.get("min"), spec.get("max"), spec.get("n")
    ok = (exact is None or n == exact) and (lo is None or n >= lo) and (hi is None or n <= hi)
    want = " ".join(f"{k} {v}" for k, v in (("exactly", exact), ("at least", lo), ("at most", hi)) if v is not None)
    return ok, f"{n} {what} (want {want})"


def _has_word(text: str, word: str) -> int:
    return len(re.findall(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.I))


def _json(text: str, spec: Mapping[str, Any]) -> tuple[bool, str]:
    body = text.strip()
    m = re.fullmatch(r"```(?:json)?\s*\n?(.*?)\n?```", body, re.S | re.I)
    if m:
        body = m.group(1).strip()
    try:
        value = json.loads(body)
    except ValueError as e:
        return False, f"not JSON: {e}"
    return isinstance(value, (dict, list)), f"JSON {type(value).__name__}"


def _case(text: str, upper: bool) -> tuple[bool, str]:
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return False, "no letters"
    bad = [c for c in letters if (c.islower() if upper else c.isupper())]
    return not bad, f"{len(bad)} letters in the wrong case"


def _ends(text: str, spec: Mapping[str, Any]) -> tuple[bool, str]:
    end = text.strip().strip('"').lower()
    phrase = str(spec["phrase"]).strip().lower()
    return end.endswith(phrase), f"ends with {text.strip()[-len(phrase) - 10:]!r}"


def _starts(text: str, spec: Mapping[str, Any]) -> tuple[bool, str]:
    return text.strip().lower().startswith(str(spec["phrase"]).strip().lower()), f"starts with {text.strip()[:40]!r}"


CHECKS: dict[str, Check] = {
    "word_count": lambda t, s: _count_ok(len(words(t)), s, "words"),
    "sentence_count": lambda t, s: _count_ok(len(sentences(t)), s, "sentences"),
    "paragraph_count": lambda t, s: _count_ok(len(paragraphs(t, s.get("separator"))), s, "paragraphs"),
    "char_count": lambda t, s: _count_ok(len(t.strip()), s, "characters"),
    "bullet_count": lambda t, s: _count_ok(len(bullets(t)), s, "bullets"),
    "forbidden_words": lambda t, s: (not (bad := [w for w in s["words"] if _has_word(t, w)]), f"uses {bad}"),
    "required_words": lambda t, s: (not (miss := [w for w in s["words"] if _has_word(t, w) < s.get("min_count", 1)]),
                                    f"missing {miss}"),
    "keyword_frequency": lambda t, s: _count_ok(_has_word(t, s["word"]), s, f"times {s['word']!r}"),
    "json_format": _json,
    "lowercase": lambda t, s: _case(t, upper=False),
    "uppercase": lambda t, s: _case(t, upper=True),
    "ends_with": _ends,
    "starts_with": _starts,
    "no_commas": lambda t, s: ("," not in t and "，" not in t, f"{t.count(',')} commas"),
    "title": lambda t, s: (bool(re.search(r"<<[^\n]+>>", t)), "a <<title>>"),
    "quotation": lambda t, s: (len(t.strip()) > 1 and t.strip()[0] == t.strip()[-1] == '"', "wrapped in quotes"),
    "placeholders": lambda t, s: _count_ok(len(re.findall(r"\[[^\[\]]+\]", t)), {"min": s.get("min", 1)},
                                           "[placeholders]"),
    "postscript": lambda t, s: (bool(re.search(rf"(?m)^\s*{re.escape(s.get('marker', 'P.S.'))}", t)),
                                f"a line starting with {s.get('marker', 'P.S.')!r}"),
}


def _relation(kw: Mapping[str, Any], key: str) -> dict[str, Any]:
    n = int(kw[key])
    rel = str(kw.get("relation", "at least")).lower()
    if rel == "less than":
        return {"max": n - 1}
    if rel == "at least":
        return {"min": n}
    raise RewardError(f"unknown IFEval relation {rel!r} (want 'less than' or 'at least')")


# IFEval instruction id -> (our check, kwargs -> spec)
IFEVAL: dict[str, tuple[str, Callable[[Mapping[str, Any]], dict[str, Any]]]] = {
    "length_constraints:number_words": ("word_count", lambda k: _relation(k, "num_words")),
    "length_constraints:number_sentences": ("sentence_count", lambda k: _relation(k, "num_sentences")),
    "length_constraints:number_paragraphs": ("paragraph_count", lambda k: {"n": int(k["num_paragraphs"]),
                                                                           "separator": "***"}),
    "keywords:forbidden_words": ("forbidden_words", lambda k: {"words": list(k["forbidden_words"])}),
    "keywords:existence": ("required_words", lambda k: {"words": list(k["keywords"])}),
    "keywords:frequency": ("keyword_frequency", lambda k: {"word": k["keyword"], **_relation(k, "frequency")}),
    "detectable_format:json_format": ("json_format", lambda k: {}),
    "detectable_format:number_bullet_lists": ("bullet_count", lambda k: {"n": int(k["num_bullets"])}),
    "detectable_format:title": ("title", lambda k: {}),
    "change_case:english_lowercase": ("lowercase", lambda k: {}),
    "change_case:english_capital": ("uppercase", lambda k: {}),
    "startend:end_checker": ("ends_with", lambda k: {"phrase": k["end_phrase"]}),
    "startend:quotation": ("quotation", lambda k: {}),
    "punctuation:no_comma": ("no_commas", lambda k: {}),
    "detectable_content:number_placeholders": ("placeholders", lambda k: {"min": int(k["num_placeholders"])}),
    "detectable_content:postscript": ("postscript", lambda k: {"marker": k["postscript_marker"]}),
}


def constraints_of(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The row's constraints as actloop specs (from `constraints` or IFEval's columns)."""
    if row.get("constraints") is not None:
        specs = [dict(c) for c in row["constraints"]]
    elif row.get("instruction_id_list") is not None:
        kwargs = row.get("kwargs") or [{}] * len(row["instruction_id_list"])
        specs = []
        for iid, kw in zip(row["instruction_id_list"], kwargs):
            if iid not in IFEVAL:
                raise RewardError(f"IFEval instruction {iid!r} is not supported (supported: {', '.join(sorted(IFEVAL))})")
            name, make = IFEVAL[iid]
            specs.append({"type": name, **make({k: v for k, v in (kw or {}).items() if v is not None}), "id": iid})
    else:
        raise RewardError("an instruction row needs `constraints` or `instruction_id_list`")
    for s in specs:
        if s.get("type") not in CHECKS:
            raise RewardError(f"unknown constraint type {s.get('type')!r}; known: {', '.join(sorted(CHECKS))}")
    if not specs:
        raise RewardError("an instruction row with no constraints cannot be graded")
    return specs


def grade_instructions(text: str, constraints: Sequence[Mapping[str, Any]], mode: str = "fraction") -> Grade:
    """Check every constraint; reward = fraction satisfied, or all-or-nothing (`mode="all"`)."""
    if mode not in ("fraction", "all"):
        raise RewardError(f"instruction reward mode must be 'fraction' or 'all', got {mode!r}")
    results = []
    for spec in constraints:
        try:
            ok, detail = CHECKS[spec["type"]](text, spec)
        except KeyError as e:
            raise RewardError(f"constraint {dict(spec)} lacks field {e}") from None
        results.append({"type": spec["type"], "ok": bool(ok), "detail": detail})
    info = {"constraints": results, "passed": sum(r["ok"] for r in results), "total": len(results)}
    if not text.strip():
        return Grade(0.0, (Flag("empty_response", "an empty answer satisfies some constraints vacuously"),), info)
    frac = info["passed"] / len(results)
    return Grade(float(frac == 1.0) if mode == "all" else frac, (), info)


def instructions_reward(mode: str = "fraction") -> Callable[..., list[Grade]]:
    """A TRL-signature reward over rows with `constraints` or IFEval columns."""

    def instructions(prompts: list, completions: list[str], **columns: Any) -> list[Grade]:
        out = []
        for i, text in enumerate(completions):
            row = {k: v[i] for k, v in columns.items() if isinstance(v, (list, tuple)) and len(v) == len(completions)}
            out.append(grade_instructions(text, constraints_of(row), mode))
        return out

    return instructions
