"""The engine: scheduler, prefix cache, engine core and its client, the Serve deployment."""
