"""Messages that cross a process: what the scheduler sends a rank for one step, and what comes back."""
