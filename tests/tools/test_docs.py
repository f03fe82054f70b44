"""The docs hold together: every link from the README and between the pages of docs/ resolves (its
file and its anchor), every page is linked from the README and has a current table of contents
(`python tools/doctoc.py`), and every file of the repository and every `xronos.*` module the docs
name exists — so a moved module or a renamed result file shows here, naming the page."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import doctext

REPO = doctext.REPO
_spec = importlib.util.spec_from_file_location("doctoc", REPO / "tools" / "doctoc.py")
doctoc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doctoc)

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
TOP = ("common", "protocol", "gateway", "node", "cli", "bench", "systemd", "tests", "tools", "examples", "docs")
PACKAGES = {"common", "protocol", "gateway", "node", "cli", "bench"}  # xronos.<name> is the folder <name>/
ENTRY_POINT_GROUPS = {"xronos.commands"}  # pyproject.toml's, named like a module


def _links(path: Path):
    outside = re.sub(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", "", path.read_text(), flags=re.S | re.M)
    return LINK.findall(outside)


def test_every_link_resolves():
    broken, checked = [], 0
    for path in doctext.FILES:
        for target in _links(path):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto: — not ours to check
                continue
            checked += 1
            file, _, frag = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{doctext.name(path)}: {target}: no such file")
            elif frag and dest.suffix == ".md" and frag not in doctoc.anchors(dest.read_text()):
                broken.append(f"{doctext.name(path)}: {target}: no heading #{frag} in {dest.name}")
    assert checked > 40 and broken == []


def test_every_page_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in _links(doctext.README)}
    assert [doctext.name(p) for p in doctext.PAGES if p.resolve() not in linked] == []


def test_every_page_has_a_current_table_of_contents():
    for page in doctext.PAGES:
        text = page.read_text()
        assert doctoc.START in text and doctoc.END in text, f"{page.name} has no table of contents"
        entries = text.split(doctoc.START, 1)[1].split(doctoc.END, 1)[0].strip().splitlines()
        assert len(entries) >= 2, f"{page.name}: a table of contents of {len(entries)} entries"
        assert doctoc.refreshed(text) == text, f"{page.name}: table of contents out of date (python tools/doctoc.py)"


def test_the_readme_is_a_front_door():
    """About 300 lines at most: what, the two commands, install, a first job, LoRA, the model."""
    text = doctext.README.read_text()
    assert len(text.splitlines()) <= 300
    for heading in ("## The two commands", "## Hardware it is for", "## Install on a box", "## A first job from the CLI",
                    "## A first job from Home Assistant", "## LoRA", "## Using the fine-tuned model",
                    "## Where to read more"):
        assert f"\n{heading}\n" in text, heading
    assert re.search(r"```sh\nmake demo .*\nmake test .*\n```", text)


def _named_paths():
    for path in doctext.FILES:
        doc = path.read_text()
        for span in doctext.spans(doc):
            if re.fullmatch(rf"(?:{'|'.join(TOP)})/[\w./*-]*", span):
                yield path, span


def test_every_repository_file_the_docs_name_exists():
    missing, seen = [], 0
    for path, named in _named_paths():
        seen += 1
        found = list(REPO.glob(named.rstrip("/"))) if "*" in named else (REPO / named).exists()
        if not found:
            missing.append(f"{doctext.name(path)}: {named}")
    assert seen > 60 and missing == []


def _defines(module: Path, name: str) -> bool:
    source = module.read_text()
    return bool(re.search(rf"^(?:async def|def|class) {name}\b|^{name}\s*[:=]|^(?:from \S+ )?import .*\b{name}\b",
                          source, re.M))


def _resolves(dotted: str) -> bool:
    """`xronos.gateway.planner.plan`: a module (file or package) of ours, then at most one name
    defined at its top level."""
    parts = dotted.split(".")[1:]
    if not parts or parts[0] not in PACKAGES:
        return False
    here = REPO / parts[0]
    for i, part in enumerate(parts[1:], 1):
        if (here / part).is_dir():
            here = here / part
        elif (here / f"{part}.py").exists():
            here = here / f"{part}.py"
        elif here.is_dir():
            return i == len(parts) - 1 and _defines(here / "__init__.py", part)
        else:
            return i == len(parts) - 1 and _defines(here, part)
    return True


def test_every_module_the_docs_name_exists():
    missing, seen = [], 0
    for path in doctext.FILES:
        doc = path.read_text()
        names = [m for s in doctext.spans(doc) for m in re.findall(r"^xronos(?:\.\w+)+", s)]
        names += [m for line in doctext.code_lines(doc) for m in re.findall(r"python -m (xronos(?:\.\w+)+)", line)]
        for dotted in names:
            seen += 1
            if dotted not in ENTRY_POINT_GROUPS and not _resolves(dotted):
                missing.append(f"{doctext.name(path)}: {dotted}")
    assert seen > 60 and missing == []


def test_every_job_spec_the_docs_show_is_valid(tmp_path):
    """A TOML block in the docs is a job spec a person copies: it must load, and say what
    examples/job.toml says for the keys it shares with it."""
    import tomllib

    from xronos.protocol.specfile import load_spec

    def leaves(doc: dict, at: str = "") -> dict:  # {"recipe.lora.r": 8, ...}
        return {k: v for key, value in doc.items()
                for k, v in (leaves(value, f"{at}{key}.") if isinstance(value, dict) else {f"{at}{key}": value}).items()}

    example = leaves(tomllib.loads((REPO / "examples" / "job.toml").read_text()))
    blocks = [(p, b) for p in doctext.FILES for b in re.findall(r"```toml\n(.*?)```", p.read_text(), re.S)]
    assert blocks
    for i, (path, block) in enumerate(blocks):
        spec = tmp_path / f"spec{i}.toml"
        spec.write_text(block)
        assert load_spec(spec).name, doctext.name(path)
        shown = leaves(tomllib.loads(block))
        assert {k: v for k, v in shown.items() if example.get(k, v) != v} == {}, doctext.name(path)


def test_the_example_job_spec_names_every_key():
    """README: examples/job.toml "has every key, commented": each field of the job spec, its recipe
    and its LoRA table is there, set or commented out."""
    from xronos.protocol.messages import JobSpec
    from xronos.protocol.recipe import LoraSpec, Recipe

    text = (REPO / "examples" / "job.toml").read_text()
    written = set(re.findall(r"^#?\s*([a-z_]+)\s*=", text, re.M))
    missing = [f"{model.__name__}.{name}" for model in (JobSpec, Recipe, LoraSpec) for name in model.model_fields
               if name not in written and name not in ("recipe", "lora")]
    assert missing == []
