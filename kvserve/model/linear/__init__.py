"""Linear methods: one object per weight format, chosen at load, called by the one layer loop.

A decoder layer is four products (q|k|v, o, gate|up, down) between elementwise steps. Each
product is a `LinearMethod` that owns its weights in the form its kernel reads (float, int8
panels, 4-bit blocks) and multiplies an activation in the form it wants: its `input`, an
`ActivationFormat`. The layer loop (kvserve/model/llama.py) never branches on the format; it
asks the method that reads an activation to make it:

    h = method.input.normed(x, delta, norm)   # x += delta; rmsnorm(x) * norm, in its form
    h = method.input.rows(t)                  # model-dtype rows (the attention output)
    h = method.input.gated(gate_up)           # silu(gate) * up of a gate|up product
    y = method.apply(h)                       # the product, in the method's own output form
    t = method.dense(y)                       # that output as model-dtype rows (+ bias)

so a format fuses what sits between its products (a residual add, a norm and the activation's
quantization in one kernel) without the loop knowing. `add_residual(x, y)` adds a product to the
residual stream where nothing reads it next (after the last layer).

The loader (kvserve/model/llama.py's builders) picks the method of every tensor from the file's
tensor types and the precision settings: float (kvserve/model/linear/float.py), int8 with the
residual stream rotated (int8.py; the rotation is the whole model's, so all four products of
every layer are int8), or GGUF's 4-bit blocks kept as they are (q4.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ActivationFormat(Protocol):
    """How a method's input is made from the residual stream, from rows, or from a gate|up
    product. `delta` and `gate_up` are products of other methods (`LinearMethod.apply`)."""

    def normed(
        self, x: torch.Tensor, delta: Any | None, weight: torch.Tensor | None, eps: float
    ) -> Any:
        """x += delta (in place, when given); rmsnorm(x) * weight (None: no weight, it was
        folded into the products that read it) in this format. x: [rows, hidden] float32."""
        ...

    def rows(self, t: torch.Tensor) -> Any:
        """Rows in the model dtype ([rows, width]) in this format."""
        ...

    def gated(self, gate_up: Any) -> Any:
        """silu(gate) * up of a gate|up product (gate columns first) in this format."""
        ...


class LinearMethod(Protocol):
    """One product `y = x @ W.T (+ bias)` with W held in its format's layout."""

    in_features: int
    out_features: int
    input: ActivationFormat

    def apply(self, h: Any) -> Any:
        """The product of an activation in `input`'s format, in this method's output form."""
        ...

    def dense(self, y: Any) -> torch.Tensor:
        """An output of `apply` as rows of the model dtype, bias added: [rows, out]."""
        ...

    @property
    def num_bytes(self) -> int:
        """Bytes of weights a product reads."""
        ...

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors this method is made of, by name (for the prepared-weight cache)."""
        ...


def add_residual(x: torch.Tensor, y: Any) -> None:
    """x += y for a product y of any method, in place (x: [rows, hidden] float32)."""
    adder = getattr(y, "add_to", None)
    if adder is not None:
        adder(x)
    else:
        x.add_(y)
