"""Exception types. Every error a user can cause is an ``SdquantError``: the CLI prints its message on
one line and exits 2. Anything else is a bug and exits 1."""


class SdquantError(Exception):
    """Bad input from the user: a config field, a file, a shape. The message names what is wrong."""


class ConfigError(SdquantError, ValueError):
    """An invalid configuration. The message starts with the dotted field path."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}" if field else problem)


class PackageError(SdquantError):
    """A .sd2 package (or an imported checkpoint) that is malformed, corrupt, hostile or unsupported."""


class ShapeError(SdquantError, ValueError):
    """A tensor shape that a quantizer or kernel cannot handle (e.g. K not divisible by the group size)."""
