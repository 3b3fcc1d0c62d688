"""Maths grader: exactly one final answer, normalised to an exact number, compared exactly.

Where the final answer is (first kind found wins):
1. markers — ``#### N`` (rest of the line), ``\\boxed{...}`` / ``\\fbox{...}``,
   ``<answer>...</answer>``, a "Final Answer" header (rest of its line, or the paragraph under it);
2. a phrase — "the answer is N", "answer: N" — only when there is no marker;
3. the last non-empty line — only when there is neither (off with ``require_marker=True``).
Reasoning blocks (``<think>``, ``<thought>``, ``<reasoning>``) are left out first.

Numbers are normalised to exact fractions: thousands separators (``1,000``), currency and
units around them (``$18``, ``18 dollars``, ``25%``), decimals (``18.00 == 18``), fractions
(``3/4``, ``\\frac{3}{4}``, ``2 1/2``), signs (``-5``, ``−5``), exponents (``1e3``). In an
``a = b = c`` chain only what follows the last ``=`` counts.

One answer, no hedging: every final-answer span must hold one number (repeats of the same
number are fine); several distinct numbers in a span is ``hedged_answer`` (2-3) or
``answer_spray`` (4+); spans that disagree are ``conflicting_answers``; 8+ distinct numbers
after the final-answer marker, or a bare run of 10+ numbers anywhere, is ``answer_spray``.
Each of these scores 0 whatever the numbers are.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from actloop.rewards.base import RewardError
from actloop.rewards.flags import Flag, Grade

HEDGE = "hedged_answer"
SPRAY = "answer_spray"
CONFLICT = "conflicting_answers"

SPRAY_MIN_IN_SPAN = 4  # distinct numbers in one final-answer span
SPRAY_MIN_IN_TAIL = 8  # distinct numbers after the last final-answer marker
SPRAY_MIN_RUN = 10  # numbers in a row, separated only by commas, spaces, "or", "and"

_REASONING = re.compile(r"<(think|thought|thinking|reasoning)>.*?(?:</\1>|\Z)", re.S | re.I)
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_FINAL_HEADER = re.compile(r"(?im)^[ \t>#*_-]*final[ \t]+answer[ \t*_]*[:：]?[ \t*_]*(.*)$")
_PHRASE = re.compile(r"(?i)\b(?:the\s+)?(?:final\s+)?answer\s*(?:is|:|=)\s*:?\s*([^\n]*)")

_NUMBER = re.compile(
    r"""
    (?<![\w./])                                     # not glued to a word or a decimal point
    (?P<sign>[-−+](?=\s?\$?\s?[\d.]))?
    \s?\$?\s?
    (?:
      (?P<whole>\d+)\s+(?P<mn>\d+)\s*/\s*(?P<md>\d+)        # mixed number: 2 1/2
    | (?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)   # 1,234.5 / 18 / .5
      (?P<exp>[eE][-+]?\d+)?
      (?:\s*/\s*(?P<den>\d+(?:\.\d+)?))?                    # a fraction: 3/4
    )
    (?![\d])
    """,
    re.X,
)
_BARE = r"[-−]?\$?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?"
_RUN = re.compile(
    rf"(?<![\w.])(?:{_BARE}(?:\s*[,;|]\s*|\s+)(?:(?:or|and)\s+)?){{{SPRAY_MIN_RUN - 1},}}{_BARE}(?![\w.])"
)


def _latex_to_text(s: str) -> str:
    s = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\text(?:bf|rm|it)?\s*\{([^{}]*)\}", r" \1 ", s)
    s = s.replace("{,}", ",").replace("\\$", "$").replace("\\%", "%").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"\\(?:left|right|displaystyle|mathrm|quad|qquad)", " ", s)
    s = re.sub(r"\((\d+(?:\.\d+)?)\)/\((\d+(?:\.\d+)?)\)", r"\1/\2", s)  # (3)/(4) -> 3/4
    return s


def numbers_in(text: str) -> list[Fraction]:
    """Every number in `text`, in order, as exact fractions."""
    out = []
    for m in _NUMBER.finditer(_latex_to_text(text)):
        try:
            if m.group("whole"):
                den = int(m.group("md"))
                if den == 0:
                    continue
                v = int(m.group("whole")) + Fraction(int(m.group("mn")), den)
            else:
                v = Fraction(m.group("num").replace(",", ""))
                if m.group("exp"):
                    v *= Fraction(10) ** int(m.group("exp")[1:])
                if m.group("den"):
                    den = Fraction(m.group("den"))
                    if den == 0:
                        continue
                    v /= den
        except (ValueError, ZeroDivisionError, OverflowError):
            continue
        if m.group("sign") in ("-", "−"):
            v = -v
        out.append(v)
    return out


def parse_number(text: str) -> Fraction | None:
    """The one number `text` states (after the last `=`), or None when it states none or
    several distinct ones."""
    vals = set(numbers_in(_after_equals(text)))
    return vals.pop() if len(vals) == 1 else None


def _after_equals(s: str) -> str:
    return s.rsplit("=", 1)[1] if "=" in s else s


def _boxes(text: str) -> list[tuple[int, str]]:
    out = []
    for m in _BOX.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out.append((m.start(), text[m.end(): i - 1 if depth == 0 else i]))
    return out


def _final_header_spans(text: str) -> list[tuple[int, str]]:
    out = []
    for m in _FINAL_HEADER.finditer(text):
        rest = m.group(1).strip()
        if not rest:  # the header stands alone: the answer is the paragraph under it
            below = text[m.end():].lstrip("\n")
            rest = below.split("\n\n", 1)[0]
        out.append((m.start(), rest))
    return out


@dataclass(frozen=True)
class Extraction:
    """What a completion states as its final answer."""

    value: Fraction | None  # the one final answer, or None (none found, or ambiguous)
    spans: tuple[str, ...]  # the final-answer texts found
    kind: str  # "marker", "phrase", "last_line" or "none"
    flags: tuple[Flag, ...] = ()


def _span_flag(span: str, where: str) -> tuple[Fraction | None, Flag | None]:
    vals = list(dict.fromkeys(numbers_in(_after_equals(span))))
    if len(vals) <= 1:
        return (vals[0] if vals else None), None
    shown = ", ".join(_fmt(v) for v in vals[:8]) + (", ..." if len(vals) > 8 else "")
    name = SPRAY if len(vals) >= SPRAY_MIN_IN_SPAN else HEDGE
    return None, Flag(name, f"{where} states {len(vals)} different numbers: {shown} ({span.strip()[:80]!r})")


def _fmt(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{float(v):g}"


def extract_final_answer(text: str, require_marker: bool = False) -> Extraction:
    """Find the final answer and check there is exactly one. See the module docstring."""
    flags: list[Flag] = []
    run = _RUN.search(text)
    if run:
        flags.append(Flag(SPRAY, f"a run of {SPRAY_MIN_RUN}+ bare numbers: {run.group(0)[:80]!r}"))
    body = _REASONING.sub(" ", text)
    marked = sorted(
        [(m.start(), m.group(1)) for m in _HASHES.finditer(body)]
        + _boxes(body)
        + [(m.start(), m.group(1)) for m in _ANSWER_TAG.finditer(body)]
        + _final_header_spans(body)
    )
    if marked:
        kind, spans = "marker", [s for _, s in marked]
        tail = body[marked[-1][0]:]
        distinct = set(numbers_in(tail))
        if len(distinct) >= SPRAY_MIN_IN_TAIL:
            flags.append(Flag(SPRAY, f"{len(distinct)} different numbers after the final-answer marker"))
    elif not require_marker and (phrases := [m.group(1) for m in _PHRASE.finditer(body) if numbers_in(m.group(1))]):
        kind, spans = "phrase", [re.split(r"(?<!\d)\.(?!\d)|\.\s", p, maxsplit=1)[0] for p in phrases]
    elif not require_marker and body.strip():
        kind, spans = "last_line", [[ln for ln in body.strip().splitlines() if ln.strip()][-1]]
    else:
        return Extraction(None, (), "none", tuple(flags))
    values: list[Fraction] = []
    for s in spans:
        v, f = _span_flag(s, "the final answer" if kind != "last_line" else "the last line")
        if f is not None:
            flags.append(f)
        elif v is not None:
            values.append(v)
    distinct_vals = list(dict.fromkeys(values))
    if len(distinct_vals) > 1:
        flags.append(Flag(CONFLICT, f"{len(spans)} final answers disagree: " + ", ".join(_fmt(v) for v in distinct_vals[:8])))
    value = distinct_vals[0] if len(distinct_vals) == 1 and not flags else None
    return Extraction(value, tuple(spans), kind, tuple(flags))


def gold_value(answer: Any) -> Fraction:
    """The gold number from a GSM8K answer (``... #### 18``), a number, or a numeric string."""
    if isinstance(answer, bool) or answer is None:
        raise RewardError(f"gold answer {answer!r} is not a number")
    if isinstance(answer, (int, float)):
        return Fraction(answer)
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    v = parse_number(text)
    if v is None:
        raise RewardError(f"gold answer {str(answer)[-80:]!r} does not state exactly one number")
    return v


def grade_math(completion: str, answer: Any, require_marker: bool = False) -> Grade:
    """1.0 when the completion's one final answer equals the gold answer exactly, else 0.0."""
    gold = gold_value(answer)
    ex = extract_final_answer(completion, require_marker)
    ok = ex.value is not None and ex.value == gold
    return Grade(1.0 if ok else 0.0, ex.flags,
                 {"predicted": None if ex.value is None else _fmt(ex.value), "gold": _fmt(gold), "kind": ex.kind})


def math_correct(prompts: list, completions: list[str], answer: list[Any], **kwargs: Any) -> list[Grade]:
    """TRL-signature reward: 1.0 for the one correct final answer (column `answer`: a GSM8K
    solution ending in ``#### N``, or a number), 0.0 otherwise, with flags for hedging."""
    return [grade_math(c, a) for c, a in zip(completions, answer)]

