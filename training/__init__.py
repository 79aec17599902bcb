"""EAGLE head training: data generation with the engine, trainer, export."""
