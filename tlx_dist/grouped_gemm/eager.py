"""Custom ops whose eager calls run their bodies directly.

    @custom_op("tlx_dist::name")                  # instead of torch.library.custom_op(..., mutates_args=())
    def _name_op(x: torch.Tensor, backend: str) -> torch.Tensor: ...
    @_name_op.register_fake                       # as on the op
    def _(x, backend): ...
    _name_op.register_autograd(backward, setup_context=setup_context)   # optional, as on the op

    y = _name_op(x, "reference")                  # eager: the body; anything traced: the op

A custom op's call passes through several Python dispatch layers (the op call, its autograd
wrapper, the redispatch below autograd, the dynamo-disable wrapper around the body) that in eager
mode only cost host time: a layer making a dozen such calls per pass is host-bound at a few
thousand tokens. :class:`EagerCustomOp` registers the op as usual -- ``torch.ops.tlx_dist.name``,
its fake implementation, its autograd formula, opcheck, torch.compile are unchanged -- and calls
the body itself when nothing is tracing. The registered op runs, unchanged, whenever any of these
holds (:func:`traced`):

- torch.compile / dynamo is tracing (``torch.compiler.is_compiling()``);
- a TorchDispatchMode is active: FakeTensorMode, FunctionalTensorMode, the proxy mode of
  ``make_fx`` / ``torch.export``, selective activation checkpointing, a user's mode
  (FlopCounterMode, a logging mode);
- a TorchFunctionMode is active (a user's, or ``torch.device(...)`` as a context manager /
  ``torch.set_default_device``): the mode sees the op as one call and the body runs outside it,
  as it always has;
- a functorch transform is active (``vmap``, ``torch.func.grad``): its wrapped tensors have type
  ``torch.Tensor``, so the type check below does not see them;
- ``torch.jit.trace`` is recording;
- a tensor argument is of any type but ``torch.Tensor`` / ``nn.Parameter`` (DTensor, FakeTensor,
  FunctionalTensor, any other subclass), at the top level or inside a list / tuple argument.

Autograd: an op without a formula whose call autograd would record (grad mode on, an input
requiring grad) also runs as the op, which does what it always did. An op with a formula records a
direct call through :class:`_EagerAutograd`, an ``autograd.Function`` that runs the same
``setup_context`` (with the op's defaults filled in, as the op passes them) and the same
``backward`` (with ``ctx.needs_input_grad`` of the op's inputs), so the same tensors are saved and
the same gradients computed. Otherwise the body runs as the op's no-grad path runs it.

The ops are functional (``mutates_args=()``): the op checks that no output aliases an input, the
direct call does not (the bodies return fresh tensors; the tests check it per op). Under
torch.profiler a direct call runs inside ``record_function(<op name>)``, so traces keep the name.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch
import torch.autograd.profiler as _profiler

__all__ = ["custom_op", "EagerCustomOp", "traced"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # nn.Parameter of a plain tensor: no dispatch override


def _plain(a) -> bool:
    if isinstance(a, torch.Tensor):
        return type(a) in _PLAIN
    if isinstance(a, (list, tuple)):
        for t in a:
            if not _plain(t):
                return False
    return True


def traced(args: tuple, kwargs: dict) -> bool:
    """True when a call with these arguments must go through the registered op (module docstring)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack() or torch._C._functorch.peek_interpreter_stack() is not None
            or torch._C._get_tracing_state() is not None):
        return True
    for a in args:
        if not _plain(a):
            return True
    for a in kwargs.values():
        if not _plain(a):
            return True
    return False


class EagerCustomOp:
    """A functional torch custom op (``op``, a ``torch.library.CustomOpDef``) that eager calls
    bypass (module docstring). ``body`` is the decorated function; ``name`` the op's qualified name."""

    def __init__(self, name: str, body: Callable):
        params = inspect.signature(body).parameters.values()
        if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
            raise TypeError(f"custom_op({name!r}): the body may only take positional-or-keyword parameters")
        self.name = name
        self.body = body
        self.op = torch.library.custom_op(name, mutates_args=())(body)
        self.__doc__, self.__name__ = body.__doc__, body.__name__
        self._signature = inspect.signature(body)
        self._num_params = len(self._signature.parameters)
        self._backward: Optional[Callable] = None
        self._setup_context: Optional[Callable] = None

    def register_fake(self, fn: Callable) -> Callable:
        """The op's fake implementation (``CustomOpDef.register_fake``); usable as a decorator."""
        self.op.register_fake(fn)
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Optional[Callable] = None) -> None:
        """The op's autograd formula (``CustomOpDef.register_autograd``), also used by direct calls."""
        self.op.register_autograd(backward, setup_context=setup_context)
        self._backward, self._setup_context = backward, setup_context

    def __call__(self, *args, **kwargs):
        if traced(args, kwargs):
            return self.op(*args, **kwargs)
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args, **kwargs):
            if self._backward is None:  # no formula: what the op does (its backward raises)
                return self.op(*args, **kwargs)
            return _EagerAutograd.apply(*self._inputs(args, kwargs), self)
        return self.run_body(*args, **kwargs)

    def run_body(self, *args, **kwargs):
        """The body, inside ``record_function(name)`` while torch.profiler records."""
        if _profiler._is_profiler_enabled:
            with torch.profiler.record_function(self.name):
                return self.body(*args, **kwargs)
        return self.body(*args, **kwargs)

    def _inputs(self, args: tuple, kwargs: dict) -> tuple:
        """Every argument positionally, defaults filled in: what the op's setup_context receives."""
        if not kwargs and len(args) == self._num_params:
            return args
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.args

    def __repr__(self) -> str:
        return f"EagerCustomOp({self.name!r})"


class _EagerAutograd(torch.autograd.Function):
    """A direct call of an op with an autograd formula: the forward runs the body and the op's
    setup_context, the backward the op's backward. The op object travels as the last input (as
    the op's own generated autograd function carries its metadata), so ``ctx.needs_input_grad``
    is trimmed to the op's inputs for the backward."""

    @staticmethod
    def forward(ctx, *args):
        *inputs, eop = args
        inputs = tuple(inputs)
        out = eop.run_body(*inputs)
        if eop._setup_context is not None:
            eop._setup_context(ctx=ctx, inputs=inputs, output=out)
        ctx._eager_op = eop
        return out

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad
        try:
            ctx.needs_input_grad = needs[:-1]
            result = ctx._eager_op._backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (*result, None) if isinstance(result, tuple) else (result, None)


def custom_op(name: str) -> Callable[[Callable], EagerCustomOp]:
    """``torch.library.custom_op(name, mutates_args=())`` whose eager calls run the body directly:
    decorate the body; the result is an :class:`EagerCustomOp` (module docstring)."""
    return lambda body: EagerCustomOp(name, body)
