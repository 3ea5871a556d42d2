"""The one error type for bad user input: it names the field and what is allowed."""


class ValidationError(ValueError):
    """A request or config value outside its allowed range.

    `field` is the name the user wrote (a request input or a config key); the message says what
    range or type is allowed, so it can be passed to the client unchanged (Triton INVALID_ARG).
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
