"""User-facing errors: the CLI prints them as one line and exits non-zero, never a traceback."""


class UserError(Exception):
    """A problem the user can fix. `str()` is the one line the CLI prints."""

    exit_code = 2


class ConfigError(UserError):
    """A config field is wrong. Always names the field and says how to fix it."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(f"config error: {field}: {problem}; {fix}")


class DataError(UserError):
    """A data file or data set cannot be used as given."""

    def __init__(self, source: str, problem: str, fix: str):
        self.source, self.problem, self.fix = source, problem, fix
        super().__init__(f"data error: {source}: {problem}; {fix}")
