"""The XTML chat renderer and the tokenizer, in plain Python (stdlib only), for the training data.

This is a re-implementation of the subset of `crates/k3-tokenizer/src/xtml.rs` (`render_chat`)
that gen_data.py produces, so that the data can be generated on the GPU machine without the
`k3` binary, tiktoken or `regex`. It must render exactly as the server does; test_render.py
checks it id for id against `k3 render-chat` (the Rust renderer) on generated conversations,
and the encoder against tiktoken on the whole corpus.

Subset: a request `{"messages", "tools", "reasoning_effort", "tool_choice"}` with messages of
role system / user / assistant (`content`, `reasoning_content`, `tool_calls` whose `arguments`
is a JSON object string) / tool (`tool_call_id`, string `content`); text in printable ASCII
plus `\\n`. Anything else raises.

Each rendered segment carries a `train` flag: true for what the model generates in an assistant
message (after the generation stub `<|open|>think<|sep|>`, or `<|open|>response<|sep|>` with
thinking off, up to and including `<|end_of_msg|>`), so the loss can be put on those tokens.
"""
import base64
import json
import re

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
# offsets of the control tokens after the last rank (around-backbone §6.3)
CONTROL_OFFSETS = {"[BOS]": 0, "[EOS]": 1, END_OF_MSG: 2, OPEN: 3, CLOSE: 4, SEP: 5}

EFFORT_BODY = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
               "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
               "`thinking_effort={}`.")
TOOLS_BODY = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
NOTES = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}

ALLOWED = set(chr(c) for c in range(0x20, 0x7F)) | {"\n"}


def check_text(s):
    bad = set(s) - ALLOWED
    if bad:
        raise ValueError(f"text outside printable ASCII + newline: {sorted(bad)!r} in {s[:60]!r}")


def xtml_type(v):
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, dict):
        return "object"
    if isinstance(v, list):
        return "array"
    raise TypeError(type(v))


class Builder:
    def __init__(self):
        self.out = []          # (text, control, train)
        self.train = False

    def seg(self, text, control=False):
        if text:
            if not control:
                check_text(text)
            self.out.append((text, control, self.train))

    def open(self, tag, attrs=()):
        self.seg(OPEN, True)
        self.seg(tag)
        for k, v in attrs:
            self.seg(f" {k}")
            self.seg('="')
            self.seg(v.replace("&", "&amp;").replace('"', "&quot;"))
            self.seg('"')
        self.seg(SEP, True)

    def close(self, tag):
        self.seg(CLOSE, True)
        self.seg(tag)
        self.seg(SEP, True)

    def end_message(self):
        self.close("message")
        self.seg(END_OF_MSG, True)

    def system_note(self, kind, body):
        self.open("message", [("role", "system"), ("type", kind)])
        self.seg(body.strip())
        self.end_message()


def render_segments(req, add_generation_prompt=True):
    """Segments of `req` as the Rust `build_segments` makes them (the subset above)."""
    known = {"messages", "tools", "reasoning_effort", "tool_choice", "model", "max_tokens", "temperature"}
    extra = set(req) - known
    if extra:
        raise ValueError(f"render.py does not implement {sorted(extra)}")
    effort = req.get("reasoning_effort") or "max"
    thinking = effort != "none"
    if thinking and effort not in ("low", "high", "max"):
        raise ValueError(effort)
    b = Builder()
    tools = req.get("tools")
    if tools:
        b.open("message", [("role", "system"), ("type", "tool-declare")])
        b.seg(TOOLS_BODY.format(json.dumps(tools, ensure_ascii=False, separators=(",", ":"), sort_keys=True)))
        b.end_message()
    if thinking:
        b.system_note("thinking-effort", EFFORT_BODY.format(effort))
    last_calls, tool_index = [], 0
    for i, m in enumerate(req["messages"]):
        role = m["role"]
        if role in ("system", "user"):
            assert set(m) <= {"role", "content"}, m
            b.open("message", [("role", role)])
            b.seg(m.get("content") or "")
            b.end_message()
        elif role == "tool":
            assert set(m) <= {"role", "content", "tool_call_id"}, m
            tool_index += 1
            # the Rust renderer re-sorts tool results into call order; we always emit them in order
            call = last_calls[tool_index - 1]
            assert call["id"] == m["tool_call_id"], "tool results must follow their calls' order"
            b.open("message", [("role", "tool"), ("tool", call["function"]["name"]), ("index", str(tool_index))])
            b.seg(m.get("content") or "")
            b.end_message()
        elif role == "assistant":
            assert set(m) <= {"role", "content", "reasoning_content", "tool_calls"}, m
            last_calls, tool_index = m.get("tool_calls") or [], 0
            ids = [c["id"] for c in last_calls]
            assert len(set(ids)) == len(ids)
            b.open("message", [("role", "assistant")])
            if thinking:
                b.open("think")
                r = m.get("reasoning_content")
                # a history turn sent back without its reasoning is not what the model generates:
                # no loss on it
                b.train = bool(r and r.strip())
                if b.train:
                    b.seg(r)
                b.close("think")
                b.open("response")
            else:
                b.open("response")
                b.train = True
            b.seg(m.get("content") or "")
            b.close("response")
            if last_calls:
                b.open("tools")
                for j, c in enumerate(last_calls):
                    f = c["function"]
                    args = json.loads(f["arguments"])
                    assert isinstance(args, dict)
                    b.open("call", [("tool", f["name"]), ("index", str(j + 1))])
                    for k, v in args.items():
                        b.open("argument", [("key", k), ("type", xtml_type(v))])
                        b.seg(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
                        b.close("argument")
                    b.close("call")
                b.close("tools")
            b.end_message()
            b.train = False
        else:
            raise ValueError(f"messages[{i}].role {role!r}")
    tc = req.get("tool_choice")
    if isinstance(tc, str) and tc in NOTES:
        b.system_note("tool-choice", NOTES[tc])
    if add_generation_prompt:
        b.open("message", [("role", "assistant")])
        b.open("think" if thinking else "response")
    return b.out


# ---------------------------------------------------------------------------------------------
# tokenizer: Kimi's pat_str restricted to printable ASCII + "\n" (check_text enforces that), and
# tiktoken's rank BPE

_L, _U, _LO, _N = "A-Za-z", "A-Z", "a-z", "0-9"
_CONTR = "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
ASCII_PAT = re.compile("|".join([
    rf"[^\r\n{_L}{_N}]?[{_U}]*[{_LO}]+{_CONTR}",
    rf"[^\r\n{_L}{_N}]?[{_U}]+[{_LO}]*{_CONTR}",
    rf"[{_N}]{{1,3}}",
    rf" ?[^\s{_L}{_N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
]))


class Encoder:
    """tiktoken-equivalent encoder for ASCII text (ranks from a tiktoken.model file)."""

    def __init__(self, tiktoken_model):
        self.ranks = {}
        for line in open(tiktoken_model, "rb"):
            if line.strip():
                tok, r = line.split()
                self.ranks[base64.b64decode(tok)] = int(r)
        self.n_ranks = len(self.ranks)
        self.special = {name: self.n_ranks + off for name, off in CONTROL_OFFSETS.items()}
        self.decoder = {r: t for t, r in self.ranks.items()}
        self.cache = {}

    def bpe(self, piece):
        ids = self.cache.get(piece)
        if ids is not None:
            return ids
        parts = [bytes([c]) for c in piece.encode()]
        while len(parts) > 1:
            best, bi = None, -1
            for i in range(len(parts) - 1):
                r = self.ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best):
                    best, bi = r, i
            if best is None:
                break
            parts[bi:bi + 2] = [parts[bi] + parts[bi + 1]]
        ids = [self.ranks[p] for p in parts]
        self.cache[piece] = ids
        return ids

    def encode(self, text):
        check_text(text)
        out = []
        for piece in ASCII_PAT.findall(text):
            out.extend(self.bpe(piece))
        return out

    def encode_segments(self, segments):
        """-> (ids, train mask) for segments from render_segments."""
        ids, mask = [], []
        for text, control, train in segments:
            t = [self.special[text]] if control else self.encode(text)
            ids.extend(t)
            mask.extend([int(train)] * len(t))
        return ids, mask

    def decode(self, ids):
        inv = {v: k for k, v in self.special.items()}
        return "".join(inv[i] if i in inv else self.decoder[i].decode("utf-8", "replace") for i in ids)


def pretokenize_counts(segments, counts):
    """Adds the pre-tokens of the text segments to `counts` (for the BPE trainer)."""
    for text, control, _ in segments:
        if not control:
            for piece in ASCII_PAT.findall(text):
                counts[piece] += 1
