"""The docs' topics are the topic table's: docs/protocol.md's table says what the table does, row
for row, and every topic the README or a docs page names is one the table (or Home Assistant's
discovery) has."""

import re

import doctext
from xronos.gateway.homeassistant.discovery import HAContext
from xronos.protocol.messages import REQUEST_MODELS
from xronos.protocol.topics import ENTRIES, TopicTable

PAGE = doctext.DOCS / "protocol.md"
# A level that stands for an id or a name in the docs: {node_id}, <id>, <its node_id>, +.
PLACEHOLDER = re.compile(r"\{[^}]*\}|<[^>]*>|\+")


def test_the_topic_api_table_matches_code():
    text = PAGE.read_text()
    section = text.split("## The topic table", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `\{base\}/([^`]+)` \|[^|]*\|[^|]*\| (\w+) \| (yes|no) \|$", section, re.M)
    assert rows == [(e.pattern, e.encoding, "yes" if e.retained else "no") for e in ENTRIES if e.root == "base"]
    assert all(f"`{{prefix}}/{e.pattern}`" in section for e in ENTRIES if e.root == "discovery")


def _concrete(topic: str) -> list[str]:
    """The topic with its placeholders filled in: a request or response name by every request
    name, any other level by an id."""
    if re.search(r"gateway/(request|response)/(\{name\}|<name>)$", topic):
        return [PLACEHOLDER.sub(lambda _: "n1", topic.rsplit("/", 1)[0]) + f"/{n}" for n in REQUEST_MODELS]
    return [PLACEHOLDER.sub("n1", topic)]


def test_every_topic_the_docs_name_is_in_the_table():
    table, ha = TopicTable(), HAContext()
    patterns = [e.pattern for e in ENTRIES]
    named, wrong = 0, []
    for path in doctext.FILES:
        for span in doctext.spans(doctext.text(path)):
            m = re.fullmatch(r"(\{base\}|xronos|\{prefix\}|homeassistant)/((?:node|gateway|job|device|status)\S*)", span)
            if not m and re.fullmatch(r"(node|job)/(\{[^}]*\}|<[^>]*>)/\S+", span):  # under the base, said short
                m = re.fullmatch(r"()(.*)", span)
            if not m or " " in span:
                continue
            named += 1
            root, rest = m.groups()
            if root in ("{prefix}", "homeassistant"):
                # Home Assistant's birth topic (in the table) or the discovery config the gateway writes.
                ok = rest == "status" or PLACEHOLDER.sub("x", rest) == ha.discovery_topic("x").split("/", 1)[1]
            elif rest.endswith(("#", "…")):  # a wildcard or an elided tail: a prefix of some topic
                prefix = PLACEHOLDER.sub("{}", rest.rstrip("#…"))
                ok = any(re.sub(r"\{\w+\}", "{}", p).startswith(prefix) for p in patterns)
            else:
                ok = all(table.match(f"xronos/{t}") for t in _concrete(rest))
            if not ok:
                wrong.append(f"{doctext.name(path)}: {span}")
    assert named > 40 and wrong == []
