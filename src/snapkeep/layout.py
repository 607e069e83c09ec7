"""What a snapshot holds beyond modules and optimizers, written once in the engine for every
door (public names): the data loader's position (:mod:`snapkeep._core.state.data_position`: batches
consumed, the loader's generators, its geometry and sampler epoch) and the global random number
generators (:mod:`snapkeep._core.state.rng_state`: Python, NumPy, torch CPU and CUDA)."""

from snapkeep._core.state.data_position import (
    LoaderPosition,
    StatefulLoaderState,
    check_loaders,
    generator_states,
    is_stateful_loader,
    loader_position,
    set_generator_states,
)
from snapkeep._core.state.rng_state import (
    RngState,
    RngStream,
    capture_rng_state,
    restore_rng_state,
    to_bytes,
    to_tensor,
)

__all__ = ["LoaderPosition", "RngState", "RngStream", "StatefulLoaderState",
           "capture_rng_state", "check_loaders", "generator_states", "is_stateful_loader",
           "loader_position", "restore_rng_state", "set_generator_states", "to_bytes",
           "to_tensor"]
