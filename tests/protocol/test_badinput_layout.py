"""Bad layouts from a person (`--layout`, `--reshard-at`) or from a file (a checkpoint's state.json):
refused with the kind and the numbers named, in one line, never a pydantic report."""

import pytest

from xronos.protocol.layout import MAX_COUNT, Layout, LayoutError

OK = "attn=6,6;mlp=64,36;vocab=64,64"


@pytest.mark.parametrize("text, message", [
    # int() would take these: "6_0" as 60, "+6", and other scripts' digits (Arabic-Indic six).
    ("attn=6_0,6;mlp=64,36;vocab=64,64", "--layout: attn must be comma-separated integers"),
    ("attn=+6,6;mlp=64,36;vocab=64,64", "--layout: attn must be comma-separated integers"),
    ("attn=\u0666,6;mlp=64,36;vocab=64,64", "--layout: attn must be comma-separated integers"),
    ("attn=6,6;mlp=1e2,0;vocab=64,64", "--layout: mlp must be comma-separated integers"),
    ("attn=6,,6;mlp=64,36;vocab=64,64", "--layout: attn must be comma-separated integers"),
    ("attn=;mlp=64,36;vocab=64,64", "--layout: attn must be comma-separated integers"),
    # Beyond the wire's bound: named, not a pydantic error (and no 5000-digit int() either).
    ("attn=6,6;mlp=99999999999,36;vocab=64,64", f"--layout: mlp counts must be in 0..{MAX_COUNT}"),
    ("attn=6,6;mlp=" + "9" * 5000 + ",36;vocab=64,64", f"--layout: mlp counts must be in 0..{MAX_COUNT}"),
    ("attn=6,6;mlp=-99999999999,36;vocab=64,64", f"--layout: mlp counts must be in 0..{MAX_COUNT}"),
    ("attn=-1,13;mlp=64,36;vocab=64,64", "--layout: attn counts must be >= 0, got [-1, 13]"),
    (";".join(f"{k}=" + ",".join(["0"] * 300) for k in ("attn", "mlp", "vocab")), "--layout: 300 ranks, at most 256"),
])
def test_malformed_counts_are_refused_naming_the_kind(text, message):
    with pytest.raises(LayoutError) as err:
        Layout.parse(text)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_whitespace_around_separators_is_the_same_layout():
    # "attn= 6,6" used to split at the space and report attn as '' (empty).
    for text in ("attn= 6,6;mlp=64,36;vocab=64,64", "attn = 6, 6 ; mlp=64 ,36 vocab=64,64", OK.replace(";", "  ")):
        assert Layout.parse(text) == Layout.parse(OK), text


@pytest.mark.parametrize("raw, message", [
    ({"attn": [-1, 13], "mlp": [64, 36], "vocab": [32, 5]}, "attn[0]: Input should be greater than or equal to 0 (got -1)"),
    ({"attn": [6, 6], "mlp": [64, 36]}, "vocab: Field required"),
    ({"attn": [6.5, 6], "mlp": [64, 36], "vocab": [32, 5]}, "attn[0]: Input should be a valid integer (got 6.5)"),
    ({"attn": [6, 6], "mlp": [64, 36], "vocab": [32, 5, 0]}, "every kind needs one count per rank"),
    ([1, 2], "(got [1, 2])"),
])
def test_decoded_layouts_are_refused_in_one_line(raw, message):
    with pytest.raises(LayoutError) as err:
        Layout.from_data(raw)
    assert message in str(err.value) and "\n" not in str(err.value) and "pydantic" not in str(err.value)
    assert Layout.from_data(Layout.parse(OK).model_dump()) == Layout.parse(OK)
