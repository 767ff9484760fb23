"""The field types and the custom check the config's option models share (klbench.config.training, resources)."""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field


Str = Annotated[str, Field(min_length=1)]
PosInt = Annotated[int, Field(ge=1)]


def _check(ok) -> AfterValidator:
    """A custom check of a value: ok(value) -> bool. The field's Expect says what the value must be."""
    def run(value):
        if not ok(value):
            raise ValueError("invalid")
        return value
    return AfterValidator(run)



