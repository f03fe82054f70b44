"""A resource set up on entering a `with` block and torn down on leaving it, for things made of
several parts (namespaces and links, cgroups and directories): `_create` makes them one by one,
recording each, and `close` undoes whatever was made. A setup that fails part-way undoes the
parts it made before the error goes on, so nothing is left behind on the host."""

from __future__ import annotations

from typing import Self


class Scoped:
    def _create(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
