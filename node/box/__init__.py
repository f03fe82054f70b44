"""This box: what it is (`capabilities`), what work will ask of it (`footprint`), and the bounds every
process the node starts runs within (`limits`, entered by `python -m xronos.node.box.boxed`)."""
