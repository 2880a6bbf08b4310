"""How a loaded target runs: the one place its kernel, product, compilation and submission
choices live. Fixed when the target is loaded; validated once, here."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError
from .kernels import MODES, backend

QMM_CHOICES = ("auto", "mlx", "ours")
# Where a GPU runs, a verify block goes to the device every this many layers as it is built
# (fewer submissions leave the device idle longer, more cost a submission each); on the CPU
# at its wait, where the device's compute would hide the overlap anyway.
SUBMIT_EVERY_GPU = 8


@dataclass(frozen=True)
class Options:
    """``kernels``: ``auto`` (native kernels after a run-time check against the ops
    reference), ``native`` (unchecked) or ``ops`` (the reference only). ``qmm``: the quantized
    matmul, ``ours`` (one weight read for 1-32 rows, rows exact by construction), ``mlx``
    (MLX's own) or ``auto`` (ours on CUDA, where it measured faster end to end; MLX's tuned
    Metal product elsewhere). ``compile``: decode steps and verify blocks run as
    ``mx.compile``d layer functions (a 27B step's graph takes as long to build op by op as the
    GPU takes to run it). ``submit_every``: a verify block is submitted every this many layers
    as it is built (0: once, at its wait; None: ``SUBMIT_EVERY_GPU`` on a GPU, 0 on the CPU).
    ``graph``: once a step or block length has settled, run it as one compiled graph of the
    whole decoder (False: layer by layer, as before it settled; for comparisons)."""

    kernels: str = "auto"
    qmm: str = "auto"
    compile: bool = True
    submit_every: int | None = None
    graph: bool = True

    def __post_init__(self) -> None:
        if self.kernels not in MODES:
            raise UsageError(f"must be one of {', '.join(MODES)}, got {self.kernels!r}",
                             param="kernels")  # fmt: skip
        if self.qmm not in QMM_CHOICES:
            raise UsageError(f"must be one of {', '.join(QMM_CHOICES)}, got {self.qmm!r}",
                             param="qmm")  # fmt: skip
        for name in ("compile", "graph"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be True or False, got {getattr(self, name)!r}")
        every = self.submit_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or not 0 <= every <= 1024):  # fmt: skip
            raise UsageError(f"submit_every must be a number of layers in [0, 1024], got {every!r}")

    @property
    def ours(self) -> bool:
        """Whether quantized layers run through our product."""
        return self.qmm == "ours" or (self.qmm == "auto" and backend() == "cuda")

    @property
    def layers_a_submit(self) -> int:
        if self.submit_every is not None:
            return self.submit_every
        return 0 if backend() == "cpu" else SUBMIT_EVERY_GPU

    @property
    def qmm_label(self) -> str:
        """The product as resolved on this backend, and whether ``auto`` chose it."""
        return ("ours" if self.ours else "mlx") + (" (auto)" if self.qmm == "auto" else "")

    def describe(self) -> str:
        return f"kernels {self.kernels}, quantized matmul {self.qmm_label}"
