"""The Ollama Modelfile beside a GGUF export: `ollama create NAME -f Modelfile` is the only step left.

Ollama's TEMPLATE is a Go template over the conversation (`.Messages`, each `.Role`/`.Content`),
not the Jinja chat template Hugging Face tokenizers carry. Rather than parse Jinja, the chat
template is *measured*: it is rendered (by the tokenizer's own apply_chat_template) on
conversations whose contents are unique markers, and the text around the markers gives each role's
prefix and suffix, the text that opens the assistant's answer, what comes before the first
message, and a default system prompt if the template inserts one when none is given. That is the
shape of the common templates (ChatML as Qwen's, Llama 3's headers, Zephyr's, Phi-3's...): each
message is its role's prefix, its content, its role's suffix. The Go template rebuilt from those
pieces is then checked against the Jinja rendering on other conversations; if any differs (a
template with logic beyond that shape, e.g. one that reorders messages or renders tools), no
TEMPLATE is written and the Modelfile says so: Ollama then picks its built-in template matching
the chat template it finds in the GGUF file's metadata.

A default system prompt becomes Ollama's SYSTEM (Ollama puts it first when a chat has none); the
stop tokens are the EOS token and the special tokens the template puts around messages; a model
without a chat template gets Ollama's plain completion template.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARK = {"system": "XSYSMARKX", "user": "XUSERMARKX", "assistant": "XASSTMARKX"}
PLAIN_TEMPLATE = "{{ .Prompt }}"
MAX_NUM_CTX = 4096  # Ollama's context: the model's, at most this (a 32k context would not fit a Pi)


@dataclass(frozen=True)
class ChatShape:
    """A chat template as role-wise text: begin + (pre[role] + content + post[role])... + gen."""

    begin: str
    pre: dict[str, str]
    post: dict[str, str]
    gen: str
    default_system: str | None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """What the Go template emits for this conversation (Ollama's system prompt included), for a
        conversation that ends with a closed message (Ollama leaves a last assistant message open
        to continue it, `go_template`)."""
        if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": self.default_system}, *messages]
        out = self.begin
        for m in messages:
            out += self.pre[m["role"]] + m["content"] + self.post[m["role"]]
        if add_generation_prompt and messages and messages[-1]["role"] != "assistant":
            out += self.gen
        return out


def measure(render, bos: str | None = None) -> ChatShape | None:
    """The role-wise shape of a chat template; `render(messages, add_generation_prompt)` -> text.
    None when the renderings do not fit that shape."""
    def conv(*roles: str) -> list[dict[str, str]]:
        return [{"role": r, "content": MARK[r]} for r in roles]

    def between(text: str, roles: tuple[str, ...]) -> list[str] | None:
        out, rest = [], text
        for r in roles:
            head, sep, rest = rest.partition(MARK[r])
            if not sep:
                return None
            out.append(head)
        return out + [rest]

    # The same marker twice (user, then user again) is told apart by position: split in order.
    full = between(render(conv("system", "user", "assistant", "user"), True), ("system", "user", "assistant", "user"))
    nogen = between(render(conv("system", "user", "assistant", "user"), False), ("system", "user", "assistant", "user"))
    ua = between(render(conv("user", "assistant"), False), ("user", "assistant"))
    u = between(render(conv("user"), False), ("user",))
    if not (full and nogen and ua and u) or full[:4] != nogen[:4] or not full[4].startswith(nogen[4]):
        return None
    t0, t1, t2, t3, t4 = full
    post_u, gen = nogen[4], full[4][len(nogen[4]):]
    post_a = ua[2]
    if ua[1] != t2 or not t2.startswith(post_u) or not t3.startswith(post_a) or u[1] != post_u:
        return None
    pre_a, pre_u = t2[len(post_u):], t3[len(post_a):]
    if not (t1.endswith(pre_u) and u[0].endswith(pre_u)):
        return None
    post_s, begin_u = t1[:len(t1) - len(pre_u)], u[0][:len(u[0]) - len(pre_u)]
    if t0.startswith(begin_u):  # no system prompt of its own
        return ChatShape(begin_u, {"system": t0[len(begin_u):], "user": pre_u, "assistant": pre_a},
                         {"system": post_s, "user": post_u, "assistant": post_a}, gen, None)
    # A default system prompt: begin + pre_s + DEFAULT + post_s before the first user message.
    if not (begin_u.startswith(t0) and begin_u.endswith(post_s)):
        return None
    # Where begin ends and the system prefix starts is not measurable here: begin is taken to be the
    # BOS text when the rendering starts with it (Llama 3's), else nothing.
    default = begin_u[len(t0):len(begin_u) - len(post_s)]
    begin = bos if bos and t0.startswith(bos) else ""
    return ChatShape(begin, {"system": t0[len(begin):], "user": pre_u, "assistant": pre_a},
                     {"system": post_s, "user": post_u, "assistant": post_a}, gen, default)


CHECKS = (("user",), ("system", "user"), ("user", "assistant", "user"),
          ("system", "user", "assistant", "user", "assistant", "user"), ("user", "assistant"))


def verified(shape: ChatShape, render) -> bool:
    """The shape rebuilds the Jinja rendering of other conversations, other contents."""
    words = iter(f"w{i} words here" for i in range(100))
    for roles in CHECKS:
        msgs = [{"role": r, "content": next(words)} for r in roles]
        for gen in (True, False) if roles[-1] != "assistant" else (False,):
            if shape.render(msgs, gen) != render(msgs, gen):
                return False
    return True


def go_template(shape: ChatShape, omit_begin: bool) -> str:
    """Ollama's Go template for the shape. No trim markers: every literal is emitted verbatim."""
    # The last assistant message is left open (Ollama continues it), as Ollama's own templates do.
    roles = "".join(
        f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{r}" }}}}{shape.pre[r]}{{{{ .Content }}}}'
        + (f"{{{{ if not $last }}}}{shape.post[r]}{{{{ end }}}}" if r == "assistant" else shape.post[r])
        for i, r in enumerate(("system", "user", "assistant")))
    return ("" if omit_begin else shape.begin) + \
        "{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}" + roles + \
        '{{ end }}{{ if and $last (ne .Role "assistant") }}' + shape.gen + "{{ end }}{{ end }}"


def _quoted(text: str) -> str:
    if '"""' in text:
        raise ValueError('the chat template\'s text holds """, which a Modelfile cannot quote')
    return f'"""{text}"""'


def modelfile_text(gguf_name: str, tokenizer: Any, max_positions: int, add_bos: bool) -> str:
    """The Modelfile for GGUF file `gguf_name` (beside it), from the transformers tokenizer."""
    lines = [f"# Ollama: ollama create NAME -f Modelfile   (made by Xronos from {gguf_name})",
             f"FROM ./{gguf_name}"]
    specials = [t for t in tokenizer.all_special_tokens if t]
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    stops = [tokenizer.eos_token] if tokenizer.eos_token else []
    if tokenizer.chat_template:
        def render(msgs, gen):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        shape = measure(render, tokenizer.bos_token)
        if shape is not None and verified(shape, render) and "{{" not in "".join(
                [shape.begin, shape.gen, *shape.pre.values(), *shape.post.values()]):
            omit = bool(shape.begin) and add_bos and shape.begin == tokenizer.bos_token
            lines.append(f"TEMPLATE {_quoted(go_template(shape, omit))}")
            if shape.default_system is not None:
                lines.append(f"SYSTEM {_quoted(shape.default_system)}")
            text = "".join([shape.gen, *shape.pre.values(), *shape.post.values()])
            stops += [t for t in dict.fromkeys(specials + added) if t in text]
        else:
            lines.append("# TEMPLATE: the chat template is not one this export translates (each message a role "
                         "prefix, its content and a role suffix); Ollama chooses its built-in template matching "
                         "the chat template stored in the GGUF file (tokenizer.chat_template).")
    else:
        lines.append(f"TEMPLATE {_quoted(PLAIN_TEMPLATE)}")
    for stop in dict.fromkeys(stops):
        if '"' not in stop:
            lines.append(f'PARAMETER stop "{stop}"')
    lines.append(f"PARAMETER num_ctx {min(max_positions, MAX_NUM_CTX)}")
    return "\n".join(lines) + "\n"


def write_modelfile(path: str | Path, gguf_name: str, tokenizer_dir: str | Path, max_positions: int) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    # llama.cpp adds BOS itself when the tokenizer does (tokenizer.ggml.add_bos_token, ggufvocab).
    with_specials, plain = tok("probe")["input_ids"], tok("probe", add_special_tokens=False)["input_ids"]
    add_bos = tok.bos_token_id is not None and len(with_specials) > len(plain) and with_specials[0] == tok.bos_token_id
    Path(path).write_text(modelfile_text(gguf_name, tok, max_positions, add_bos))
    return Path(path)
