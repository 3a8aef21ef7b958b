"""Errors the engine raises to its callers; the service maps each to a gRPC status."""


class EngineError(RuntimeError):
    """The engine cannot serve (its step loop died, or it was shut down)."""


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full: the caller should back off and retry."""


class PromptTooLongError(ValueError):
    """The prompt does not fit in max_model_len (with room for at least one new token), or its
    token ids in the whole of max_queued_bytes: no retry would help."""


class NoChatTemplateError(ValueError):
    """The model ships no chat template, so chat messages cannot become a prompt."""
