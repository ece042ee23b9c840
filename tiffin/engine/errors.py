"""Engine exceptions that servers map to responses; importable without torch."""


class ParamError(ValueError):
    """A request parameter that cannot be served; `param` names it as the API spells it (OpenAI's error `param`).

    Invariant: every validation error that concerns one request field is a ParamError naming that field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """The waiting queue holds max_waiting_requests sequences, or the client's max_waiting_per_client: try again
    later."""


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


class EngineDeadError(RuntimeError):
    """The engine cannot run even a one-token forward: nothing it holds or is given can finish."""


class EngineStalled(EngineError):
    """No engine step finished within `engine_stall_timeout` while requests were in flight (the watchdog's
    verdict, tiffin.engine.watchdog): the requests in flight fail with it, and so do new ones until a step ends."""


class EngineAsleep(RuntimeError):
    """The engine sleeps (`sleep`): it takes requests again after `wake_up` (a server's 503)."""


class EngineBusy(RuntimeError):
    """Requests are in flight where an idle engine is needed (sleep, weight reload): finish or abort them first."""
