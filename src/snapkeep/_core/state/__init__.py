"""The state layout beyond modules and optimizers: the data position, the RNG streams, wrapper-free
model keys."""
