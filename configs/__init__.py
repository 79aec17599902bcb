"""Configuration: the pydantic schema (schema.py) and YAML presets."""
