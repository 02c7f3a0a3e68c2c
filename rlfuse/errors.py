"""User-facing errors: the CLI prints them as one line and exits non-zero, never a traceback."""

import contextlib
import errno


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (its type's name if it has none), cut to `limit` characters: what a
    one-line error quotes of a library's or the user's own failure."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


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


# failures of writing a file that the user fixes outside rlfuse (space, permissions, a path that is not a folder)
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP}


def os_error_line(e: OSError, command: str, run_dir: str | None = None) -> str | None:
    """One line for an OSError of WRITE_ERRNOS (the path, what happened, the fix); None for any other. command: the
    CLI command it ended (rl and run continue with --resume, sft and rm start again with --overwrite)."""
    if e.errno not in WRITE_ERRNOS:
        return None
    where = e.filename or "a file of the run"
    if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):  # the path itself: nothing of a run was touched
        return f"cannot use {where}: {e.strerror}; give a path whose every part is under 256 bytes and no loop of links"
    space = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    cause = "free space (or raise the quota) there" if space else "check the path and its permissions"
    then = {"run": f"continue with --resume {run_dir or 'RUN_DIR'} (the last checkpoint is intact)",
            "rl": f"continue with --resume {run_dir or 'RUN_DIR'} (the last checkpoint is intact)",
            "sft": "run the command again with --overwrite", "rm": "run the command again with --overwrite"}.get(command)
    return f"cannot {'write' if space else 'use'} {where}: {e.strerror}; {cause}" + (f", then {then}" if then else "")


@contextlib.contextmanager
def said_where(where: str):
    """A UserError raised in the block names where it happened (`where`, e.g. "iteration 3") in front of its line."""
    try:
        yield
    except UserError as e:
        e.args = (f"{where}: {e}",)
        raise
