"""The content oracle: an emulated KV memory driven as an engine drives it."""
