"""The errors Zephon raises for what a user wrote or gave it: each message names the file, the field or the
operator, and the fix. One home for them, imported by every layer (this module imports nothing of Zephon).
"""

from __future__ import annotations


class PipelineError(ValueError):
    """A pipeline that cannot be built as written; the message names the operator and the fix."""


class RecipeError(ValueError):
    """A recipe that cannot be run as written; the message names the file, the key and the fix."""


class RecipeFileError(RecipeError, FileNotFoundError):
    """A file a recipe or a pipeline needs (the recipe itself, a tokenizer, a template) is missing or is not a
    file. Also a :class:`FileNotFoundError`, which is what callers caught before it was a RecipeError."""


class SourceError(RuntimeError):
    """Bad input in a source file; the message names the file, the field and the fix."""


class StateError(ValueError):
    """A checkpoint that cannot be loaded here; the message says why and what to do."""


class OperatorError(RuntimeError):
    """A user function (or a built-in operator) failed on a record; the message names the operator, the
    function, the source file and the record."""


__all__ = ["OperatorError", "PipelineError", "RecipeError", "RecipeFileError", "SourceError", "StateError"]
