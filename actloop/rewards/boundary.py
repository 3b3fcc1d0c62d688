"""The boundary between a judge's instructions and the text it judges.

A judged response is data. It reaches the judge between an opening and a closing tag whose
name carries an HMAC of the response keyed by a secret the policy never sees (one per `Judge`,
so per run): the policy cannot compute the closing tag, and a guess is a 64-bit shot in the
dark. The same response gets the same tag within a run, so a judge's cache keeps working;
cache keys use `PUBLIC` instead of the secret tag, so they survive a new run too.

Before it is wrapped the text is neutralised: chat-control sequences (`<|im_end|>`,
`<|start|>`, `<|channel|>`, `[INST]`, `<<SYS>>`, ...) and tags that look like the wrapper's
(`</judged-...>`, `</response-...>`) get their angle brackets and bars swapped for look-alike
characters, so a server that parses special tokens out of message text cannot be handed a turn
boundary, and no closing tag inside the data is the real one. The judge still sees that they
were there. `quote=True` (the re-wrap after a reply that quoted the judged text) also prefixes
every line with `QUOTE`, so a quoted `SCORE: 10` no longer parses as the judge's own line.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

PREFIX = "judged"
PUBLIC = f"{PREFIX}-public"  # the tag in cache keys: the secret never reaches a cache file
QUOTE = "\u2502 "  # box-drawing bar: not among the characters a verdict line may start with

# special-token syntax of the chat formats in use (ChatML / Qwen, Harmony, Llama 2/3, Gemma,
# Mistral, Phi), and the end-of-text / turn markers that tokenizers parse out of plain text
CHAT_CONTROL = re.compile(
    r"<\|[A-Za-z_][A-Za-z0-9_.:-]{0,40}\|>"  # <|im_end|> <|start|> <|channel|> <|eot_id|> <|endoftext|>
    r"|\[/?(?:INST|SYS|SYSTEM_PROMPT|AVAILABLE_TOOLS|TOOL_CALLS|TOOL_RESULTS)\]"  # Mistral / Llama 2
    r"|<</?SYS>>"
    r"|</?(?:start_of_turn|end_of_turn|bos|eos)>"  # Gemma
    r"|<\uff5c[^<>\n]{1,40}\uff5c>"  # DeepSeek's fullwidth bars: <｜end▁of▁sentence｜>
)
# a tag the wrapper could be taken for: <judged-...>, </response-...>, < / judged_x >, ...
LOOKALIKE_TAG = re.compile(r"<\s*/?\s*(?:judged|response|data|reference)\b[^<>\n]{0,80}>", re.I)
_SWAP = str.maketrans({"<": "\u2039", ">": "\u203a", "|": "\u00a6", "[": "\u27e6", "]": "\u27e7",
                       "\uff5c": "\u00a6"})


def neutralise(text: str) -> str:
    """`text` with every chat-control sequence and wrapper look-alike tag defused (brackets and
    bars replaced by look-alike characters); everything else unchanged."""
    text = CHAT_CONTROL.sub(lambda m: m.group(0).translate(_SWAP), text)
    return LOOKALIKE_TAG.sub(lambda m: m.group(0).translate(_SWAP), text)


class Boundary:
    """Wraps judged text in tags keyed by `secret` (fresh random bytes when None).

    `tag(text, role)` is an HMAC-SHA-256 of the role ("A", "B" or "" ) and the text, 64 bits in
    hex; `wrap` neutralises the text and puts it between the tags. `public()` is the same
    boundary with `PUBLIC` as every tag, for cache keys."""

    def __init__(self, secret: bytes | None = None, *, public: bool = False) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self._public = public

    def public(self) -> Boundary:
        return Boundary(self._secret, public=True)

    def tag(self, text: str, role: str = "") -> str:
        if self._public:
            return PUBLIC
        mac = hmac.new(self._secret, role.encode() + b"\0" + text.encode(), hashlib.sha256).hexdigest()
        return f"{PREFIX}-{mac[:16]}"

    def wrap(self, text: str, role: str = "", quote: bool = False) -> tuple[str, str]:
        """(the wrapped text, its tag)."""
        t = self.tag(text, role)
        body = neutralise(text)
        if quote:
            body = "\n".join(QUOTE + line for line in body.split("\n"))
        return f"<{t}>\n{body}\n</{t}>", t
