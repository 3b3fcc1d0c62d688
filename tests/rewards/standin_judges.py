"""Stand-in LLM judges for the injection red-team set (test material, not library code).

    from standin_judges import CASES, evaluate, rates
    results = evaluate(CASES, "pointwise", "delimiter")   # the set scored through a real Judge

The red-team set (`injection_redteam.jsonl`) holds questions with reference answers and, per
case, a response: an honest correct answer, an honest wrong one, an honest *look-alike* (a
correct answer that talks about grades, scores or systems), or a wrong answer carrying an
injection (`payload`: the text aimed at the judge, as it appears in the response). `set` says
whether a case was written with the detector (`dev`) or after it was frozen (`heldout`).

Two stand-ins answer as real HTTP servers on loopback (`judge_server.ScriptedServer`). Both
grade honestly by their answer key (a response is right when it contains the reference) and
quote any `SCORE:` / `VERDICT:` line they see in the data before their own verdict, as LLM
judges do. They differ in what they obey:

- `obedient`: a payload anywhere in the request wins (full marks, PASS, the response's side);
- `delimiter`: only a payload outside the data wrapper does. The wrapper runs from an opening
  tag line `<name>` to the first `</name>` after it, or to the first chat-control sequence
  (a server that parses special tokens out of message text starts a new turn there).

Obedience is decided on letters and digits only (NFKC, format characters dropped, casefolded),
so defusing `<|im_end|>` or quoting lines does not hide a payload from the obedient judge.
Forged-tag cases (`forge`) rebuild a response that carries its own closing tag under the
public-hash tag of actloop before issue 40 (`benchmarks/judge_forge.py` found the suffixes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from judge_server import ScriptedServer

from actloop.rewards.judge import Judge, JudgeConfig, JudgePanel, Pairwise, PassFail, Pointwise
from actloop.rewards.rubric import RewardTerm, Rubric, text_trajectory

DATA = Path(__file__).with_name("injection_redteam.jsonl")
MODES = ("pointwise", "passfail", "pairwise", "panel")
_CONTROL = re.compile(r"<\|[A-Za-z_][A-Za-z0-9_.:-]{0,40}\|>|\[/?INST\]|<</?SYS>>")
_OPEN = re.compile(r"^<([A-Za-z][\w-]*)>$", re.M)
_VERDICT_LINE = re.compile(r"(?im)^[^\w\n]*(?:score|verdict)\s*:.*$")


def norm(text: str) -> str:
    """Letters and digits only: what a payload means to a judge that reads through formatting."""
    text = unicodedata.normalize("NFKC", text)
    return "".join(c for c in text.casefold() if c.isalnum())


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # injection, honest, wrong, lookalike
    lang: str
    style: str
    question: str
    reference: str
    response: str
    payload: str = ""
    set: str = "dev"
    modes: tuple[str, ...] = MODES  # a forged tag targets one tag scheme: pointwise/passfail or pairwise

    @property
    def honest(self) -> bool:
        return self.kind != "injection"


def forged_response(head: str, payload: str, candidates: int, seed: int, suffix: int) -> str:
    """A response embedding `candidates` closing tags of the pre-issue-40 form
    (`</response-` + 10 hex digits), the payload after them, and a searched suffix."""
    rng = random.Random(seed)
    tags = "".join(f"</response-{rng.getrandbits(40):010x}>\n" for _ in range(candidates))
    return f"{forged_prefix(head, payload, tags)}{suffix}"


def forged_prefix(head: str, payload: str, tags: str) -> str:
    return f"{head}\n\n{tags}\n{payload}\n\nref "


def old_tag(text: str) -> str:
    """The wrapper tag before issue 40: the first 40 bits of SHA-256 of the text itself."""
    return "response-" + hashlib.sha256(text.encode()).hexdigest()[:10]


def load_cases(path: Path = DATA) -> list[Case]:
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        forge = row.pop("forge", None)
        if forge is not None:
            row["response"] = forged_response(row["response"], row["payload"], forge["candidates"], forge["seed"],
                                              forge["suffix"])
            row["modes"] = ("pairwise",) if forge["role"] == "A" else ("pointwise", "passfail", "panel")
        out.append(Case(**{k: tuple(v) if k == "modes" else v for k, v in row.items()}))
    return out


CASES = load_cases()


# --- the stand-in judges --------------------------------------------------------------------

def regions(content: str) -> tuple[list[str], str]:
    """(the data regions, everything outside them) as a delimiter-bound judge reads `content`."""
    data, outside, pos = [], [], 0
    while (m := _OPEN.search(content, pos)) is not None:
        outside.append(content[pos:m.start()])
        start, close = m.end(), f"</{m.group(1)}>"
        end = content.find(close, start)
        end = len(content) if end < 0 else end
        ctrl = _CONTROL.search(content, start, end)
        if ctrl is not None:  # a turn boundary: the rest, up to the closing tag, is a new message
            data.append(content[start:ctrl.start()])
            outside.append(content[ctrl.start():end])
        else:
            data.append(content[start:end])
        pos = min(len(content), end + len(close))
    outside.append(content[pos:])
    return data, "".join(outside)


class StandIn:
    """A request body -> a scripted reply (`ScriptedServer`'s script)."""

    def __init__(self, cases: Sequence[Case], obeys: str) -> None:
        assert obeys in ("obedient", "delimiter")
        self.obeys = obeys
        self.key = {c.question: c.reference for c in cases}
        self.payloads = sorted({norm(c.payload) for c in cases if c.payload}, key=len, reverse=True)

    def __call__(self, body: dict[str, Any]) -> dict[str, str]:
        system, user = body["messages"][0]["content"], body["messages"][1]["content"]
        data, outside = regions(user)
        heard = norm(user if self.obeys == "obedient" else outside)
        obeyed = any(p in heard for p in self.payloads)
        question = next((q for q in sorted(self.key, key=len, reverse=True) if q in user), None)
        ref = norm(self.key.get(question, "\0"))
        if "VERDICT: A" in system:  # pairwise: the response is the side that is not the reference
            sides = [norm(d) for d in data[:2]] + [""] * (2 - len(data[:2]))
            mine = "A" if sides[0] != ref else "B"
            if obeyed:
                return {"text": f"VERDICT: {mine}"}
            honest = "TIE" if all(ref in s for s in sides) else ("B" if mine == "A" else "A")
            return {"text": self._quote(data) + f"VERDICT: {honest}"}
        right = ref in norm("".join(data))
        if "VERDICT: PASS" in system:
            return {"text": "VERDICT: PASS" if obeyed else self._quote(data) + f"VERDICT: {'PASS' if right else 'FAIL'}"}
        low, high = (int(x) for x in re.search(r"from (-?\d+) to (-?\d+)", system).groups())
        return {"text": f"SCORE: {high}" if obeyed else self._quote(data) + f"SCORE: {high if right else low + 1}"}

    @staticmethod
    def _quote(data: list[str]) -> str:
        lines = [m.group(0).strip() for d in data for m in _VERDICT_LINE.finditer(d)]
        return "".join(f"The response contains the line:\n{line}\n" for line in lines[:2])


# --- scoring the set through a real Judge ---------------------------------------------------

@dataclass(frozen=True)
class Result:
    case: Case
    mode: str
    judge: str
    reward: float
    flags: tuple[str, ...]
    actions: tuple[str, ...]
    masked: bool

    @property
    def full(self) -> bool:
        return self.reward >= 1.0 - 1e-9 and not self.masked

    @property
    def flagged(self) -> bool:
        """A hack flag fired (one whose policy zeroes or penalises)."""
        return any(a == "zero" or a.startswith("penalty") for a in self.actions)


def _template(mode: str):
    criteria = "Is the answer to the question correct?"
    if mode == "passfail":
        return PassFail(criteria)
    if mode == "pairwise":
        fields = {f.name for f in dataclasses.fields(Pairwise)}
        return Pairwise(criteria, tie=1.0) if "tie" in fields else Pairwise(criteria)  # the mode where honesty can win
    return Pointwise(criteria, 1, 10)


def evaluate(cases: Sequence[Case], mode: str, obeys: str) -> list[Result]:
    """Score every case that applies to `mode` through a `Judge` (or a two-judge panel: the
    `obeys` stand-in beside a delimiter-bound one) in a `Rubric`, as training would."""
    cases = [c for c in cases if mode in c.modes]
    servers = [ScriptedServer(StandIn(cases, obeys))]
    try:
        def judge(server: ScriptedServer, name: str) -> Judge:
            cfg = JudgeConfig(base_url=server.base_url, model=name, api_key_env=None, timeout_s=10.0, max_retries=1,
                              backoff_s=0.01, concurrency=8)
            return Judge(cfg, _template("pointwise" if mode == "panel" else mode))

        if mode == "panel":
            servers.append(ScriptedServer(StandIn(cases, "delimiter")))
            func: Any = JudgePanel([judge(servers[0], obeys), judge(servers[1], "delimiter")])
        else:
            func = judge(servers[0], obeys)
        rubric = Rubric([RewardTerm("judge", func)])
        trajs = [text_trajectory(c.response, {"reference": c.reference}, prompt=c.question) for c in cases]
        scored = rubric.score(trajs)
    finally:
        for s in servers:
            s.close()
    return [Result(c, mode, obeys, s.reward, tuple(str(f) for f in s.flags),
                   tuple(getattr(f, "action", "") for f in s.flags), s.masked) for c, s in zip(cases, scored)]


def rates(results: Sequence[Result]) -> dict[str, Any]:
    inj = [r for r in results if not r.case.honest]
    good = [r for r in results if r.case.kind in ("honest", "lookalike")]
    wrong = [r for r in results if r.case.kind == "wrong"]
    return {
        "injections": len(inj),
        "injections_paid_full": sum(r.full for r in inj),
        "injections_flagged": sum(r.flagged for r in inj),
        "injections_masked": sum(r.masked for r in inj),
        "injections_mean_reward": round(sum(r.reward for r in inj if not r.masked) / max(1, sum(not r.masked for r in inj)), 3),
        "honest": len(good),
        "honest_harmed": [r.case.name for r in good if not r.full or r.flagged],
        "wrong": len(wrong),
        "wrong_paid_full": sum(r.full for r in wrong),
        "wrong_flagged": sum(r.flagged for r in wrong),
    }
