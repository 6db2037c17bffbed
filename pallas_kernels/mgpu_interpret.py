"""The Mosaic GPU kernels on a CPU: JAX's GPU interpret mode (``plgpu.InterpretGPUParams``), completed
where jax 0.11 leaves gaps the kernels here step into.

The interpret mode runs each warpgroup of a CTA as a thread, shared memory, barriers and TMA as Python
objects, and checks the barrier protocol as it goes. The gaps, closed at ``params()``'s first call:

1. ``pl.run_state`` (every wgmma accumulator here starts from a value: ``plgpu.ACC.init``) is not
   interpreted; it is run here as an allocation holding the initial value, the body, and a read-back.
2. ``wgmma`` with A in registers (the 8-bit kernels' upcast slabs, P in the value products) expects A in
   shared memory; a register A is multiplied as the value it is.
3. A barrier's last phases must all have been waited by every thread that ever waited on it when it is
   freed. The ring's producer never waits for its consumers' last release (nothing follows it), so that
   check is dropped; a phase missed mid-kernel still fails where the barrier completes.
4. Each warpgroup's program is compiled and run by XLA's CPU thread pool, one thread a core: on a 2-core
   machine the third warpgroup never starts while two wait at barriers for it. The programs are evaluated
   eagerly instead, loops and branches in Python, so each warpgroup runs on its own thread.
5. ``plgpu.inline_mgpu`` bodies cannot be interpreted; one marked with ``stand_in(fn)`` is interpreted as
   ``fn`` of its arguments (refs among them arrive as allocation keys, to be ignored).
6. TMA stores that add into global memory (``reduction_op="add"``) are refused; they are run here.
7. Programmatic dependent launch (``griddepcontrol``) has no CPU rule; one launch runs at a time here, so
   its wait and its early start of the next launch are nothing to do.

The patches reach into ``jax._src`` and are checked against jax 0.11; tests and kernel development use
them, the engine never does (off the GPU it runs the kernels' references)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

_SUPPORTED_JAX = "0.11."


def params(**kwargs) -> plgpu.InterpretGPUParams:
    """The ``interpret=`` value for ``plgpu.kernel`` on a CPU (kwargs go to ``InterpretGPUParams``), race
    detection on unless ``detect_races=False``: ``races_found()`` reads its verdict after the kernel."""
    _install()
    return plgpu.InterpretGPUParams(**{"detect_races": True, **kwargs})


def races_found() -> bool:
    """Whether the last kernel interpreted with race detection had two threads (warpgroups, TMA) touch the
    same bytes of shared or global memory, one of them writing, with no barrier ordering them. Loads,
    stores and TMA copies are checked; wgmma's operand reads are not (jax's interpret mode does not clock
    them), nor are the add-stores run here."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return gpu_callbacks.get_races().races_found


def stand_in(fn):
    """Marks an ``inline_mgpu`` body as computing what ``fn`` (jnp, same arguments after the builder)
    computes, which the interpret mode then runs in its place."""
    def mark(body):
        body.interpret_stand_in = fn
        return body
    return mark


@functools.cache
def _install() -> None:
    if not jax.__version__.startswith(_SUPPORTED_JAX):
        raise RuntimeError(f"pallas_kernels.mgpu_interpret patches jax {_SUPPORTED_JAX}x's GPU interpret mode; "
                           f"this is jax {jax.__version__}: check what it still lacks, then update the patches")
    from jax._src.pallas.mosaic.interpret import thread_map
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory

    interpret = jaxpr_interpret.JaxprInterpreter.interpret
    jaxpr_interpret.JaxprInterpreter.interpret = functools.partialmethod(_interpret_with_run_state, interpret)
    gpu_callbacks.wgmma = functools.partial(_wgmma, gpu_callbacks.wgmma)
    inline_mgpu = jaxpr_interpret.JaxprInterpreter._interpret_inline_mgpu_p
    jaxpr_interpret.JaxprInterpreter._interpret_inline_mgpu_p = functools.partialmethod(_inline_mgpu, inline_mgpu)
    gpu_callbacks.copy_smem_to_gmem = functools.partial(_copy_smem_to_gmem, gpu_callbacks.copy_smem_to_gmem)
    shared_memory.Barrier.deallocate = _deallocate_barrier
    arithmetic = jaxpr_interpret.JaxprInterpreter._interpret_arithmetic_primitive
    jaxpr_interpret.JaxprInterpreter._interpret_arithmetic_primitive = functools.partialmethod(_skip_pdl, arithmetic)
    thread_map._run_jaxpr = _run_eagerly


# 1. run_state ------------------------------------------------------------------------------------------

def _interpret_with_run_state(self, interpret, jaxpr, token, *args):
    """JaxprInterpreter.interpret, with each run_state equation run by _run_state between the spans of
    other equations (which the original interprets)."""
    from jax._src import core
    from jax._src import linear_util as lu
    from jax._src.state.discharge import run_state_p

    if not any(eqn.primitive is run_state_p for eqn in jaxpr.eqns):
        return interpret(self, jaxpr, token, *args)
    env = dict(zip(jaxpr.constvars + jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
    span = []

    def run_span(token):
        if not span:
            return token
        defined, inputs = set(), []
        for eqn in span:
            inputs += [v for v in eqn.invars
                       if not isinstance(v, core.Literal) and v not in defined and v not in inputs]
            defined.update(eqn.outvars)
        outputs = [v for eqn in span for v in eqn.outvars if not isinstance(v, core.DropVar)]
        sub = core.Jaxpr([], inputs, outputs, list(span), core.join_effects(*(eqn.effects for eqn in span)),
                         debug_info=lu.DebugInfo("mgpu_interpret", "<a span between run_states>", None, None))
        token, values = interpret(self, sub, token, *map(read, inputs))
        env.update(zip(outputs, values))
        span.clear()
        return token

    for eqn in jaxpr.eqns:
        if eqn.primitive is run_state_p:
            token = run_span(token)
            token, values = _run_state(self, eqn, token, list(map(read, eqn.invars)))
            env.update((v, x) for v, x in zip(eqn.outvars, values) if not isinstance(v, core.DropVar))
        else:
            span.append(eqn)
    return run_span(token), list(map(read, jaxpr.outvars))


def _run_state(self, eqn, token, inputs):
    """run_state: each value input becomes a register allocation holding it (refs pass through), the body
    runs on them, and the outputs are what the allocations hold after it."""
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as callbacks
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    from jax._src.state import types as state_types

    body = eqn.params["jaxpr"]
    registers = shared_memory.get_memory_space_idx(gpu_core.MemorySpace.REGS)
    is_ref = [isinstance(v.aval, state_types.AbstractRef) for v in eqn.invars]
    refs = []
    for value, ref in zip(inputs, is_ref):
        if not ref:
            token, request = callbacks.call_make_allocation_request_array(
                token=token, compute_unit=self.thread, memory_space_id=registers, initial_ref_count=1)
            token, value = callbacks.call_allocate_buffer(token, self.mesh_location, self.thread, request, value,
                                                         source_info=eqn.source_info)
        refs.append(value)
    token, _ = self.interpret(body, token, *refs)
    outputs = []
    for var, key, ref in zip(body.invars, refs, is_ref):
        if not ref:
            token, key_value = callbacks.call_get(
                token=token, result_shape_and_dtype=var.aval.inner_aval, mesh_location=self.mesh_location,
                thread=self.thread, allocation_key_as_array=key, transforms=(), source_info=eqn.source_info)
            token = callbacks.call_deallocate_buffer(token, self.mesh_location, self.thread, key,
                                                     source_info=eqn.source_info)
            key = key_value
        outputs.append(key)
    return token, outputs


# 2. wgmma with A in registers ----------------------------------------------------------------------------

def _wgmma(wgmma, *, a_allocation_key_as_array, **kwargs):
    """gpu_callbacks.wgmma; an A that is not an allocation key is the A operand itself (from registers)."""
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory

    key_shape = shared_memory.HostAllocationKey.shape_and_dtype().shape
    if np.shape(a_allocation_key_as_array) == key_shape:
        return wgmma(a_allocation_key_as_array=a_allocation_key_as_array, **kwargs)
    b, acc = _Region(kwargs, "b"), _Region(kwargs, "acc")
    total = acc.load()
    acc.store(total + np.matmul(np.asarray(a_allocation_key_as_array), b.load(), dtype=total.dtype))
    return kwargs["token"]


class _Region:
    """The part of an allocation that a callback's ``{name}_allocation_key_as_array`` and
    ``{name}_transforms`` arguments name, read and written as this callback's thread."""

    def __init__(self, kwargs, name):
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as callbacks
        from jax._src.pallas.mosaic_gpu.interpret import shared_memory

        self.memory, self.thread = callbacks._get_shared_memory(), kwargs["thread"]
        self.key = shared_memory.HostAllocationKey.from_array(kwargs[f"{name}_allocation_key_as_array"])
        self.range = self.memory.access(
            self.key, jax.tree.map(int, callbacks._remove_noop_transforms(kwargs[f"{name}_transforms"])))
        self.logging_info = shared_memory.GPULoggingInfo(kwargs["mesh_location"], self.thread,
                                                         kwargs.get("source_info"))

    def load(self):
        return self.memory.get_buffer_content(self.key, self.range, self.thread, logging_info=self.logging_info)[0]

    def store(self, value):
        self.memory.store_buffer_content(self.key, self.range, value, self.thread, logging_info=self.logging_info)


# 3. the barrier check at deallocation ----------------------------------------------------------------------

def _deallocate_barrier(self):
    with self.cv:
        self.ref_count -= 1
        if self.ref_count == 0 and self.arrivals_count != 0:
            raise ValueError(f"Barrier deallocated with {self.arrivals_count} arrivals pending.")


# 4. each warpgroup on its own thread ------------------------------------------------------------------------

def _run_eagerly(jaxpr, consts, *args):
    _evaluate(jaxpr, consts, args)


def _evaluate(jaxpr, consts, args):
    """jaxpr's equations one by one; while, cond, scan and nested jits as Python control flow and the
    interpreter's callbacks (barrier waits among them) as Python calls, all on the calling thread."""
    from jax._src import core
    from jax._src.callback import io_callback_impl, io_callback_p
    from jax._src.lax.control_flow import cond_p, scan_p, while_p
    from jax._src.pjit import jit_p

    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
    closed = lambda cj, *xs: _evaluate(cj.jaxpr, cj.consts, xs)
    for eqn in jaxpr.eqns:
        inputs, p = list(map(read, eqn.invars)), eqn.params
        if eqn.primitive is while_p:
            num_cond, num_body = p["cond_nconsts"], p["body_nconsts"]
            cond_consts, body_consts = inputs[:num_cond], inputs[num_cond:num_cond + num_body]
            outputs = inputs[num_cond + num_body:]
            while bool(closed(p["cond_jaxpr"], *cond_consts, *outputs)[0]):
                outputs = closed(p["body_jaxpr"], *body_consts, *outputs)
        elif eqn.primitive is cond_p:
            outputs = closed(p["branches"][int(inputs[0])], *inputs[1:])
        elif eqn.primitive is scan_p:
            outputs = _scan(closed, eqn, inputs)
        elif eqn.primitive is io_callback_p:  # on this thread, not in a program on XLA's pool
            outputs = list(io_callback_impl(*inputs, **p))
        elif eqn.primitive in (jit_p, core.closed_call_p):
            outputs = closed(p["jaxpr"] if eqn.primitive is jit_p else p["call_jaxpr"], *inputs)
        else:
            outputs = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(p))
            if not eqn.primitive.multiple_results:
                outputs = [outputs]
        env.update((v, x) for v, x in zip(eqn.outvars, outputs) if not isinstance(v, core.DropVar))
    return list(map(read, jaxpr.outvars))


def _scan(closed, eqn, inputs):
    p = eqn.params
    num_consts, num_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry, xs = inputs[:num_consts], inputs[num_consts:num_consts + num_carry], inputs[num_consts + num_carry:]
    ys = []
    for i in reversed(range(length)) if p["reverse"] else range(length):
        out = closed(p["jaxpr"], *consts, *carry, *[x[i] for x in xs])
        carry = out[:num_carry]
        ys.append(out[num_carry:])
    if p["reverse"]:
        ys.reverse()
    if not ys:
        return [*carry, *(jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[num_carry:])]
    return [*carry, *(jnp.stack(column) for column in zip(*ys))]


# 5. inline_mgpu stand-ins ---------------------------------------------------------------------------------

def _inline_mgpu(self, inline_mgpu, eqn, token, get_invals):
    fn = getattr(eqn.params["mgpu_fn"], "interpret_stand_in", None)
    if fn is None:
        return inline_mgpu(self, eqn, token, get_invals)
    out = fn(*get_invals()[:eqn.params["pytree_args"].num_leaves])
    return token, list(out) if isinstance(out, (tuple, list)) else [out]


# 6. TMA stores that add ----------------------------------------------------------------------------------

def _copy_smem_to_gmem(copy, *, reduction_op, **kwargs):
    """gpu_callbacks.copy_smem_to_gmem; with reduction_op="add" the sum is stored at once (the interpret
    mode runs a grid's CTAs one after another, so no other store races it)."""
    if reduction_op is None:
        return copy(reduction_op=reduction_op, **kwargs)
    if reduction_op != "add" or kwargs["predicate"] is not None:
        raise NotImplementedError(f"a TMA store with reduction_op={reduction_op!r} (interpreted: 'add', unpredicated)")
    src, dst = _Region(kwargs, "src"), _Region(kwargs, "dst")
    total = dst.load()
    dst.store((total + src.load()).astype(total.dtype))
    return kwargs["token"]


# 7. programmatic dependent launch ----------------------------------------------------------------------------

def _skip_pdl(self, arithmetic, eqn, get_invals):
    if eqn.primitive.name in ("griddepcontrol_wait", "griddepcontrol_launch_dependents"):
        return []
    return arithmetic(self, eqn, get_invals)
