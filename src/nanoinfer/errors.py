"""The one error family users see: what happened, why it matters, how to fix it.

The CLI catches NanoInferError, prints it without a traceback and exits 2. Anything else is a bug in
nanoinfer and keeps its traceback.
"""


def short_repr(value, limit: int = 80) -> str:
    """repr() cut to `limit` characters: an error message must not echo a megabyte of input back."""
    if isinstance(value, int) and value.bit_length() > 200:  # repr() of a 5,000-digit int raises ValueError
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class NanoInferError(Exception):
    """A problem the user can fix (bad config, missing model, bad request)."""


class ConfigError(NanoInferError):
    """One or more invalid Config values; `problems` lists each one (field, value, rule, fix)."""

    def __init__(self, problems: "list[ConfigProblem] | str"):
        if isinstance(problems, str):
            problems = [ConfigProblem(field="", value=None, message=problems)]
        self.problems = list(problems)
        lines = [f"{len(self.problems)} problem(s) in the configuration:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class ConfigProblem:
    """One invalid field: which, what value, what rule it breaks and how to fix it."""

    __slots__ = ("field", "value", "message")

    def __init__(self, field: str, value, message: str):
        self.field, self.value, self.message = field, value, message

    def __str__(self) -> str:
        if not self.field:
            return self.message
        return f"{self.field} = {self.value!r}: {self.message}"

    def to_dict(self) -> dict:
        value = self.value if isinstance(self.value, (int, float, str, bool, type(None))) else repr(self.value)
        return {"field": self.field, "value": value, "message": self.message}


class ModelLoadError(NanoInferError):
    """The model folder, its weights or its source cannot be used."""


class RequestError(NanoInferError):
    """A request (prompt or sampling parameters) is invalid; `code` names the problem for scripts (the error code
    of a `generate` record: out_of_vocabulary, chat_template_error, prompt_too_long, ...)."""

    def __init__(self, message: str, code: str = "request_failed"):
        super().__init__(message)
        self.code = code


class UnservableRequestError(RequestError):
    """A well-formed request this engine can never serve: an empty prompt, or one longer than max_model_len.
    LLM.generate() answers it with an output whose finish_reason is "error" and goes on with the others."""


class StructuredOutputError(RequestError):
    """A request's structured_outputs (JSON schema, regex, choice, grammar) is invalid or cannot compile."""


class BatchFileError(NanoInferError):
    """A file-level problem with a `generate` job (input, output, resume manifest)."""


class LoRAError(NanoInferError):
    """A LoRA adapter cannot be used with this model and config: missing folder, rank over max_lora_rank, DoRA, a
    target nanoinfer does not adapt, shapes of another base model, an unknown adapter name."""


class OutOfMemoryError(NanoInferError):
    """The KV cache cannot be sized to hold what the config asks for."""


class ReplicaError(NanoInferError):
    """--data-parallel-size: Ray is missing or unreachable, the cluster cannot hold the replicas, or none is left."""


class OutputWriteError(NanoInferError):
    """The output cannot take more records (disk full, I/O error, closed stdout); `errno` says which."""

    def __init__(self, message: str, errno: int | None = None, closed_pipe: bool = False):
        super().__init__(message)
        self.errno, self.closed_pipe = errno, closed_pipe
