"""One exception type for every user-facing failure: the CLI prints its message as one line and exits non-zero."""


class AdvisorError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class NotWritable(AdvisorError, OSError):
    """An output file or folder that cannot be written (read-only, a file in the way, disk full): one line,
    exit 2, from every command alike. Still an OSError, for callers that catch those."""


def not_writable(path, error: OSError) -> NotWritable:
    """`cannot write PATH: Permission denied`, from the OSError that writing `path` raised."""
    return NotWritable(f"cannot write {path}: {error.strerror or error}")


class NotBuiltYet(AdvisorError):
    """A sub-command whose stage does not exist yet: say so instead of pretending."""

    exit_code = 3


def exception_reason(error: BaseException, limit: int = 300, named: tuple = ()) -> str:
    """`Type: message` of `error` on one line, at most `limit` characters, for a reason stored in a record or
    shown in a report. A multi-line bracketed block of the message becomes `(…)`: Python names an object that
    is called (a module: "got multiple values for keyword argument") by its repr, and a model's repr runs to
    thousands of lines, which cut at `limit` said nothing of the error. `named`: objects whose repr may appear
    in the message (the model called), shown by their class name. The full text belongs with the traceback
    (`exception_details`)."""
    text = str(error)
    for obj in named:
        try:
            shown = str(obj)
        except Exception:  # a repr that fails must not hide the error being described
            continue
        if shown and shown in text:
            text = text.replace(shown, type(obj).__name__)
    text = " ".join(_without_multiline_blocks(text).split())
    reason = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return reason if len(reason) <= limit else reason[:limit - 1] + "…"


def exception_details(error: BaseException) -> dict:
    """The full text of `error` and its traceback, to store beside a one-line reason (`exception_reason`)."""
    import traceback

    return {"error": f"{type(error).__name__}: {error}",
            "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))}


_CLOSING = {"(": ")", "[": "]", "{": "}"}


def _without_multiline_blocks(text: str) -> str:
    """`text` with the inside of each outermost bracketed block that spans lines replaced by `…`."""
    pairs, stack = {}, []
    for i, c in enumerate(text):
        if c in _CLOSING:
            stack.append(i)
        elif c in _CLOSING.values() and stack and _CLOSING[text[stack[-1]]] == c:
            pairs[stack.pop()] = i
    out, i = [], 0
    while i < len(text):
        end = pairs.get(i)
        if end is not None and "\n" in text[i:end]:
            out.append(text[i] + "…" + text[end])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
