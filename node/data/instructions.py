"""Instruction data for a causal LM: rendering a row and the labels of its answer tokens
(`xronos.node.data.batches` reads the rows and batches them).

Files: CSV, JSON, JSONL or Parquet (read with `datasets`). Formats (`Recipe.data_format`):
- "text": a text column (and a pair column); classify reads a label column, a causal LM learns
  every token that is not padding.
- "chat" (causal LM): a column of conversations, each a list of {role, content} messages (roles
  system, user, assistant), rendered with the tokenizer's chat template; the loss covers the
  assistant turns' tokens only (their content and the template's end-of-turn marker).
- "prompt-completion" (causal LM): two text columns, concatenated as they are with the tokenizer's
  EOS appended to the completion; the loss covers the completion's tokens only.
Everywhere else the labels are -100, so `TPModel.forward`'s mean is over the answer tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from xronos.node.data.labels import short_repr
from xronos.protocol.recipe import Recipe


IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Rendered:
    """A row as the model reads it, and the character spans of its answers (what the loss covers)."""

    text: str
    answers: tuple[tuple[int, int], ...]


def check_instruction_tokenizer(tokenizer: Any, cfg: Recipe) -> None:
    """What an instruction format needs of the tokenizer (ValueError naming the model dir)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"model dir {cfg.model_dir}: data format {cfg.data_format!r} needs a fast tokenizer "
                         "(tokenizer.json), to find which tokens are the answer's")
    if cfg.data_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model dir {cfg.model_dir}: the tokenizer has no chat template, which data format "
                         "'chat' needs (tokenizer_config.json 'chat_template' or chat_template.jinja); give "
                         "the data as prompt/completion columns (data format 'prompt-completion') instead")


def as_messages(value: Any, where: str) -> list[dict[str, str]]:
    """One conversation, checked: a list of {role, content} with text content, a user message
    before the first answer, no empty answer. Only role and content reach the template."""
    if isinstance(value, str):
        raise ValueError(f"{where} is text, not a list of {{role, content}} messages (a CSV cell cannot "
                         "hold one: use JSON, JSONL or Parquet)")
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of {{role, content}} messages, got {short_repr(value)}")
    out = []
    for m, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise ValueError(f"{where} message {m} is not a {{role, content}} object: {short_repr(msg)}")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise ValueError(f"{where} message {m} has role {short_repr(role)}; the roles are {list(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where} message {m} ({role}) has no text content: {short_repr(content)}")
        out.append({"role": role, "content": content})
    answers = [i for i, msg in enumerate(out) if msg["role"] == "assistant"]
    if not answers:
        raise ValueError(f"{where} has no assistant message: there is no answer to learn")
    if not any(msg["role"] == "user" for msg in out[: answers[0]]):
        raise ValueError(f"{where}: its first assistant message (message {answers[0]}) has no user message before it")
    for i in answers:
        if not out[i]["content"].strip():
            raise ValueError(f"{where} message {i} is an empty assistant answer")
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, str]], where: str) -> Rendered:
    """The conversation through the chat template, with each assistant turn's span: from the end
    of the conversation before it (generation prompt included) to the end of the turn."""
    def render(msgs: list[dict[str, str]], prompt: bool) -> str:
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
        except Exception as exc:  # jinja raises what the template raises
            raise ValueError(f"{where}: the tokenizer's chat template refused the conversation: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError(f"{where}: the chat template rendered {type(text).__name__}, not text")
        return text

    full = render(messages, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (through.startswith(before) and full.startswith(through)) or len(through) == len(before):
            raise ValueError(f"{where}: the tokenizer's chat template does not render this conversation turn "
                             f"by turn (message {i} renders differently when the conversation ends with it), "
                             "so its answer cannot be located; give each answer its own row")
        spans.append((len(before), len(through)))
    return Rendered(full, tuple(spans))


def render_prompt_completion(tokenizer: Any, prompt: str, completion: str, where: str) -> Rendered:
    """Prompt and completion as they are, the tokenizer's EOS appended to the completion (so the
    model learns to stop); the completion and its EOS are the answer."""
    if not completion.strip():
        raise ValueError(f"{where} has an empty completion: there is no answer to learn")
    eos = tokenizer.eos_token
    text = prompt + completion + (eos if eos and not completion.endswith(eos) else "")
    return Rendered(text, ((len(prompt), len(text)),))


def answer_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor, offsets: torch.Tensor,
                  special: torch.Tensor, answers: list[tuple[tuple[int, int], ...]]) -> torch.Tensor:
    """[B, S] labels: the id where a token belongs to an answer span, -100 elsewhere. offsets
    [B, S, 2] are the tokens' character spans; a token belongs to a span it overlaps, or, when
    its own span is empty (a byte-level BPE trims a lone space token to nothing), that it starts
    in. `special` [B, S] marks what the tokenizer adds around the text (BOS, ...): never an
    answer, nor is padding."""
    start, end = offsets[..., 0], offsets[..., 1]
    empty = end == start
    hit = torch.zeros_like(input_ids, dtype=torch.bool)
    for b, spans in enumerate(answers):
        for a, e in spans:
            hit[b] |= ((start[b] < e) & (end[b] > a)) | (empty[b] & (start[b] >= a) & (start[b] < e))
    hit &= attention_mask.bool() & ~special.bool()
    return input_ids.masked_fill(~hit, IGNORE_INDEX)
