"""Model state keys without wrapper prefixes (public names): a snapshot taken from a model in
one wrapping (plain, ``torch.compile``, DDP, both) resumes into any other; see
:mod:`snapkeep._core.state.wrapping`."""

from snapkeep._core.state.wrapping import (
    canonical_key,
    canonical_names,
    canonical_state,
    canonical_tree,
    dtensor_models,
    live_state,
    live_tree,
)

__all__ = ["canonical_key", "canonical_names", "canonical_state", "canonical_tree",
           "dtensor_models", "live_state", "live_tree"]
