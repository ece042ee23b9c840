"""Engine exceptions that servers map to responses; importable without torch."""


class QueueFull(RuntimeError):
    """The waiting queue holds max_waiting_requests sequences: try again later."""


class EngineDeadError(RuntimeError):
    """The engine cannot run even a one-token forward: nothing it holds or is given can finish."""
