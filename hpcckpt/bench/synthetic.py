"""A synthetic model + Adam state of a requested size, and one measured training step."""
from __future__ import annotations

import math

import torch

from ..state import TrainState

_FP32 = 4
_ADAM_COPIES = 3  # parameters, exp_avg, exp_avg_sq


class SyntheticRig:
    """Square bias-free linear layers whose parameters + Adam moments total ``state_bytes``."""

    def __init__(self, state_bytes: int, *, seed: int = 0, warm: bool = True, device: str = "cpu") -> None:
        """``warm=False``: no first step, so no Adam moments yet (a resumed job before its restore).

        ``device="cuda"``: the model and optimizer state live on the GPU, and a step
        uses a batch large enough that its compute is not negligible next to the copy.
        """
        params = max(state_bytes // (_FP32 * _ADAM_COPIES), 64 * 64)
        width = min(4096, 2 ** int(math.log2(max(64, math.isqrt(params // 2)))))
        layers = max(1, round(params / (width * width)))
        torch.manual_seed(seed)
        self.width = width
        self.device = device
        # CUDA: forward + backward of 4096 rows is ~6 x 4096 flops per parameter, about twice
        # the time a 12-byte-per-parameter D2H takes at 50 GB/s on an H100 (fp32, no TF32):
        # a step that can hide the snapshot copy, as real training steps do.
        self.rows = 4096 if device == "cuda" else 4
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
        self.model.to(device)
        for p in self.model.parameters():
            with torch.no_grad():
                p.uniform_(-1.0 / math.sqrt(width), 1.0 / math.sqrt(width))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.state = TrainState()
        self.state.register("model", self.model)
        self.state.register("optimizer", self.opt)
        if warm:
            self.forward_backward()
            self.opt.step()  # creates the Adam moments: the state now has its full size

    def forward_backward(self) -> None:
        x = torch.randn(self.rows, self.width, device=self.device)
        loss = self.model(x).square().mean()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()

    @property
    def state_bytes(self) -> int:
        flat = self.state.capture(step=0)
        return sum(t.numel() * t.element_size() for t in flat.tensors.values())

    @property
    def device_bytes(self) -> int:
        """Bytes of state that live on the GPU (what a snapshot copies device-to-host)."""
        flat = self.state.capture(step=0)
        return sum(t.numel() * t.element_size() for t in flat.tensors.values() if t.is_cuda)

    def sync(self) -> None:
        """Wait for the GPU (no-op on the CPU): timings must include queued kernels."""
        if self.device == "cuda":
            torch.cuda.synchronize()


class PeerRig:
    """Parameters + AdamW moments totalling ``state_bytes``, the state every method of
    ``bench --peers`` / ``--tensors`` saves.

    ``tensors=None``: square bias-free linear layers (as ``SyntheticRig``), a step with
    real compute. ``tensors=N``: about N state tensors (N/4 flat parameters, each with
    AdamW's exp_avg, exp_avg_sq and step), the step's gradients set in one foreach op:
    the tensor count, not the compute, is what those figures are about.
    ``warm=False``: no optimizer step yet (no moments), as a resumed job before its restore.
    """

    def __init__(self, state_bytes: int, *, tensors: int | None = None, device: str = "cpu", warm: bool = True,
                 seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.device = device
        self.spread = tensors is not None
        self.rows = 4096 if device == "cuda" else 4
        if tensors is None:
            params = max(state_bytes // (_FP32 * _ADAM_COPIES), 64 * 64)
            self.width = min(4096, 2 ** int(math.log2(max(64, math.isqrt(params // 2)))))
            layers = max(1, round(params / (self.width * self.width)))
            self.model: torch.nn.Module = torch.nn.Sequential(
                *[torch.nn.Linear(self.width, self.width, bias=False) for _ in range(layers)])
        else:
            count = max(1, tensors // 4)
            numel = max(1, state_bytes // (_FP32 * _ADAM_COPIES * count))
            self.width = numel
            self.model = torch.nn.Module()
            self.model.params = torch.nn.ParameterList(  # type: ignore[assignment]
                [torch.nn.Parameter(torch.empty(numel)) for _ in range(count)])
        self.model.to(device)
        with torch.no_grad():
            for p in self.model.parameters():
                p.uniform_(-0.05, 0.05)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.state = TrainState()
        self.state.register("model", self.model)
        self.state.register("optimizer", self.opt)
        if warm:
            self.forward_backward()
            self.opt.step()

    def forward_backward(self) -> None:
        params = list(self.model.parameters())
        if self.spread:
            grads = torch._foreach_mul([p.detach() for p in params], 1e-3)
            for p, g in zip(params, grads):
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

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
