"""Trainer engines: the interface, the factory, the torch and Megatron engines and what they share."""
