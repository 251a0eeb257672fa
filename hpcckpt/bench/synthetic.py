"""A synthetic model + Adam state of a requested size, and one measured training step."""
from __future__ import annotations

import math

import torch

from ..state import TrainState

_FP32 = 4
_ADAM_COPIES = 3  # parameters, exp_avg, exp_avg_sq


def _linear_stack(state_bytes: int) -> tuple[torch.nn.Module, int]:
    """Square bias-free linear layers holding a third of ``state_bytes`` (the rest: Adam's moments)."""
    params = max(state_bytes // (_FP32 * _ADAM_COPIES), 64 * 64)
    width = min(4096, 2 ** int(math.log2(max(64, math.isqrt(params // 2)))))
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    return model, width


def _spread(state_bytes: int, tensors: int) -> tuple[torch.nn.Module, int]:
    """``tensors // 4`` flat parameters (each brings exp_avg, exp_avg_sq and step with AdamW)."""
    count = max(1, tensors // 4)
    numel = max(1, state_bytes // (_FP32 * _ADAM_COPIES * count))
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(numel)) for _ in range(count)])
    return model, numel


class SyntheticRig:
    """Square bias-free linear layers whose parameters + Adam moments total ``state_bytes``."""

    optimizer: type[torch.optim.Optimizer] = torch.optim.Adam

    def __init__(self, state_bytes: int, *, seed: int = 0, warm: bool = True, device: str = "cpu",
                 tensors: int | None = None) -> None:
        """``warm=False``: no first step, so no Adam moments yet (a resumed job before its restore).

        ``device="cuda"``: the model and optimizer state live on the GPU, and a step
        uses a batch large enough that its compute is not negligible next to the copy.
        ``tensors=N``: about N state tensors instead of the linear layers (``_spread``); a
        step then sets the gradients in one foreach op (the count, not compute, matters).
        """
        torch.manual_seed(seed)
        self.device = device
        self.spread = tensors is not None
        # CUDA: forward + backward of 4096 rows is ~6 x 4096 flops per parameter, about twice
        # the time a 12-byte-per-parameter D2H takes at 50 GB/s on an H100 (fp32, no TF32):
        # a step that can hide the snapshot copy, as real training steps do.
        self.rows = 4096 if device == "cuda" else 4
        self.model, self.width = _spread(state_bytes, tensors) if tensors is not None else _linear_stack(state_bytes)
        self.model.to(device)
        bound = 0.05 if self.spread else 1.0 / math.sqrt(self.width)
        for p in self.model.parameters():
            with torch.no_grad():
                p.uniform_(-bound, bound)
        self.opt = self.optimizer(self.model.parameters(), lr=1e-4)  # type: ignore[call-arg]  # base Optimizer type takes no lr; the subclasses used do
        self.state = TrainState()
        self.state.register("model", self.model)
        self.state.register("optimizer", self.opt)
        if warm:
            self.forward_backward()
            self.opt.step()  # creates the Adam moments: the state now has its full size

    def forward_backward(self) -> None:
        if self.spread:
            params = list(self.model.parameters())
            for p, g in zip(params, torch._foreach_mul([p.detach() for p in params], 1e-3)):
                p.grad = g
            return
        x = torch.randn(self.rows, self.width, device=self.device)
        loss = self.model(x).square().mean()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()

    def step(self) -> None:
        self.forward_backward()
        self.opt.step()

    @property
    def state_bytes(self) -> int:
        flat = self.state.capture(step=0)
        return sum(t.numel() * t.element_size() for t in flat.tensors.values())

    @property
    def tensor_count(self) -> int:
        return len(self.state.capture(step=0).tensors)

    @property
    def device_bytes(self) -> int:
        """Bytes of state that live on the GPU (what a snapshot copies device-to-host)."""
        flat = self.state.capture(step=0)
        return sum(t.numel() * t.element_size() for t in flat.tensors.values() if t.is_cuda)

    def sync(self) -> None:
        """Wait for the GPU (no-op on the CPU): timings must include queued kernels."""
        if self.device == "cuda":
            torch.cuda.synchronize()


class PeerRig(SyntheticRig):
    """The state every method of ``bench --peers`` / ``--tensors`` saves: as ``SyntheticRig``
    (``tensors=None``: linear layers; ``tensors=N``: about N state tensors), with AdamW."""

    optimizer = torch.optim.AdamW
