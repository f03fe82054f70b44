"""The files an export writes, and what an earlier export into the same directory left.

An export directory may be used again (a job submitted again, `xronos run --export` twice). A full
fine-tune's export after a LoRA one would leave the adapter beside the new weights, and
transformers' `from_pretrained` would apply it to them; a LoRA export after a full one would leave
config.json and model.safetensors, which `AutoModel...from_pretrained` reads before the adapter; a
Modelfile would still name the old GGUF. So once an export is in place, each entry an export of
ours writes that this one did not is removed: only those names, so whatever else the user keeps
in the directory stays. Removed after the new files are in place, not before: until then the old
export is whole (each file is replaced atomically, `stage.staged`).
"""

from __future__ import annotations

from pathlib import Path
from typing import get_args

from xronos.protocol.msgtypes import GGUFType
from xronos.protocol.recipe import Recipe

from .stage import remove_entries

ADAPTER_CONFIG = "adapter_config.json"  # peft's names
ADAPTER_FILE = "adapter_model.safetensors"
MERGED_SUBDIR = "merged"  # LoRA's merged model, a Hugging Face directory of its own
FULL_FILES = ("config.json", "model.safetensors")  # `export.save_hf_dir`'s (beside the tokenizer's)
MODELFILE = "Modelfile"


def gguf_file_name(out_type: str) -> str:
    return f"model-{out_type}.gguf"


# Every entry an export of ours may write at the top of its directory, but the tokenizer's files
# (an export always writes its base model's, replacing those of the same name)
EXPORT_ENTRIES = (*FULL_FILES, ADAPTER_CONFIG, ADAPTER_FILE, MERGED_SUBDIR, MODELFILE,
                  *(gguf_file_name(t) for t in get_args(GGUFType)))


def written(recipe: Recipe) -> set[str]:
    """The entries of `EXPORT_ENTRIES` an export of this recipe writes."""
    if recipe.lora is not None:
        out = {ADAPTER_CONFIG, ADAPTER_FILE} | ({MERGED_SUBDIR} if recipe.export_merged else set())
    else:
        out = set(FULL_FILES)
    if recipe.export_gguf is not None:
        out |= {gguf_file_name(recipe.export_gguf), MODELFILE}
    return out


def remove_leftovers(out_dir: str | Path, recipe: Recipe) -> list[str]:
    """Remove what an earlier export left in `out_dir` that this recipe's export did not write
    (module docstring); return the names removed."""
    mine = written(recipe)
    return remove_entries(out_dir, [n for n in EXPORT_ENTRIES if n not in mine])
