"""The base of every config section: `Section` (extra keys and non-finite floats refused), `ConfigError`,
the seed bound."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field."""


# numpy's legacy seeding (np.random.seed, used by seed_everything) takes 0 ≤ seed < 2**32; torch and random take
# more, so numpy's range is the one every seed field is held to.
SEED_MAX = 2**32


class Section(BaseModel):
    # allow_inf_nan=False: every float field, also inside lists, tuples and dicts (optim.betas, optim.module_lr),
    # refuses nan and ±inf at load ("Input should be a finite number", naming the field) — a non-finite learning
    # rate, temperature or coefficient would otherwise train on NaN and export NaN weights.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
