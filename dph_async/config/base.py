"""The base class every config section derives from."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, values are validated on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
