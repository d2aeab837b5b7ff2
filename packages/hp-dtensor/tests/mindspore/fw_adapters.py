"""What the framework-neutral test bodies need from each framework: tensors from arrays and
back, gradients, and the ops namespace DTensor code calls (torch's functions, dispatched by
``__torch_function__``; ``hp_dtensor.ms_ops`` on MindSpore). Imported inside the ranks."""

from __future__ import annotations

import types


class Torch:
    name = "torch"

    @staticmethod
    def tensor(a):
        import torch

        return torch.tensor(a)

    @staticmethod
    def numpy(t):
        return t.detach().numpy()

    @staticmethod
    def vjp(f, x, dy):
        """f(x) and the vector-Jacobian product with ``dy``."""
        import torch

        xt = torch.tensor(x, requires_grad=True)
        y = f(xt)
        y.backward(torch.tensor(dy))
        return y.detach().numpy(), xt.grad.numpy()

    @staticmethod
    def grads(f, arrays):
        """f's (scalar) value and the gradients of all its arguments."""
        import torch

        ts = [torch.tensor(a, requires_grad=True) for a in arrays]
        y = f(*ts)
        y.backward()
        return y.detach().numpy(), [t.grad.numpy() for t in ts]

    @staticmethod
    def ops():
        import torch
        import torch.nn.functional as F

        return types.SimpleNamespace(
            rsqrt=torch.rsqrt, mean=torch.mean, linear=F.linear, reshape=torch.reshape,
            transpose=torch.transpose, softmax=F.softmax, matmul=torch.matmul, silu=F.silu,
            embedding=F.embedding, cross_entropy=F.cross_entropy, cat=torch.cat,
            rms_norm=F.rms_norm, layer_norm=F.layer_norm, mul=torch.mul,
        )  # fmt: skip


class MindSpore:
    name = "mindspore"

    @staticmethod
    def tensor(a):
        import mindspore as ms

        return ms.Tensor(a)

    @staticmethod
    def numpy(t):
        return t.asnumpy()

    @staticmethod
    def vjp(f, x, dy):
        import mindspore as ms

        xt, dyt = ms.Tensor(x), ms.Tensor(dy)
        y = f(xt)
        dx = ms.grad(lambda v: (f(v) * dyt).sum())(xt)
        return y.asnumpy(), dx.asnumpy()

    @staticmethod
    def grads(f, arrays):
        import mindspore as ms

        ts = [ms.Tensor(a) for a in arrays]
        y, gs = ms.value_and_grad(f, grad_position=tuple(range(len(ts))))(*ts)
        if isinstance(gs, ms.Tensor):  # one position: MindSpore returns the tensor itself
            gs = (gs,)
        return y.asnumpy(), [g.asnumpy() for g in gs]

    @staticmethod
    def ops():
        import hp_dtensor

        return hp_dtensor.ms_ops


FRAMEWORKS = {"torch": Torch, "mindspore": MindSpore}
