"""The project's errors. Library code raises these; only ``cli.py`` prints them.

Every message says what went wrong and what to do about it.
"""

from __future__ import annotations


class MtpError(Exception):
    """Base class of every error this tool reports to a user.

    ``param``: the input it is about, by its Python API name (``temp``, ``max_tokens``); the
    message then reads after that name, and each front end puts its own name for the input
    before it (the CLI its flag, the server its JSON field). ``str()`` uses the API name."""

    exit_code = 1

    def __init__(self, message: str = "", *, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param

    def __str__(self) -> str:
        return f"{self.param} {self.message}" if self.param else self.message


class ModelNotFoundError(MtpError):
    """A path does not exist, or a repo id cannot be resolved to a local snapshot."""


class BadConfigError(MtpError):
    """config.json is missing, unreadable, not JSON, or not the expected shape."""


class ConfigOutOfBoundsError(BadConfigError):
    """A config scalar is mistyped or outside the range any real model uses."""


class BadCheckpointError(MtpError):
    """The weight files are damaged, or their tensors do not match the config."""


class LayoutError(BadCheckpointError):
    """The files do not say, or contradict each other on, how the norm weights are stored."""


class UnsupportedModelTypeError(MtpError):
    """A model_type this tool does not know."""


class TargetNotMTPCapableError(MtpError):
    """MTP was requested for a target family that has no MTP support."""


class NotStandaloneDrafterError(MtpError):
    """A directory given as --draft-model is not a standalone qwen3_5_mtp drafter."""


class DrafterMismatchError(MtpError):
    """The drafter's shapes do not fit the target it would draft for."""


class TokenizerError(MtpError):
    """The target directory has no usable tokenizer."""


class NonFiniteOutputError(BadCheckpointError):
    """The target's first logits hold NaN or Inf: its weights cannot be decoded from."""


class PromptError(MtpError):
    """The prompt cannot be turned into tokens (bad text, or a chat template that fails)."""


class OutputError(MtpError):
    """Where the results should go cannot be written: stdout closed, an output directory
    that is a file, unwritable, or not empty."""


class Interrupted(MtpError):
    """Ctrl-C (SIGINT): the run stopped; what it was writing was removed."""

    exit_code = 130


class ServeError(MtpError):
    """``mtp serve`` cannot start: its extra is not installed, or the host and port cannot be
    listened on."""


class UsageError(MtpError):
    """An argument combination or value the engine cannot honour."""

    exit_code = 2


class BatchNotSupportedError(UsageError):
    """A batch the engines do not decode: several prompts in one array (they run one sequence
    at a time), or more requests together than the target decodes exactly."""


class ContextTooLongError(UsageError):
    """The prompt plus the tokens asked for exceed the model's positions."""


class SamplingError(UsageError):
    """Sampling settings that cannot be sampled from (e.g. a temperature of 1e-40)."""


class PipelineError(MtpError):
    """A target cannot be split over the processes ``mlx.launch`` started (more processes than
    layers), or the processes cannot reach each other."""
