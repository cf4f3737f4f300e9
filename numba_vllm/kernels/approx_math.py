"""``exp2_approx``: 2^x in one hardware instruction (``ex2.approx.ftz.f32``), for softmax kernels, and
``rcp_approx``: 1 / x (``rcp.approx.f32``, within 1 ulp), for SwiGLU (``activation.swiglu``).

Why: ``math.exp`` compiles to libdevice's accurate ``expf`` (range reduction, about eight
instructions), ``math.exp2`` without fastmath to ``ex2.approx`` plus denormal fix-ups. A softmax
written in base 2 (scores pre-multiplied by ``log2(e)``) needs only the hardware's ``ex2``: one
MUFU instruction. Its error is about 2 ulp (relative 2^-22), far below what float32 sums of
hundreds of terms carry anyway. ``fastmath=True`` would give the same instruction but also lets
the compiler assume no infinities, and softmax kernels compare with ``-inf`` (an empty row).

``ftz``: results below 2^-126 flush to 0, and ``exp2_approx(-inf) = 0`` (a masked score weighs
nothing). Under the simulator it is NumPy's ``exp2`` in float32.
"""

import math

import numpy as np

from numba_vllm.sim.warp import simulator_enabled

if simulator_enabled():

    def exp2_approx(x):
        """2^x in float32 (simulator version)."""
        return np.float32(np.exp2(np.float32(x)))

    def rcp_approx(x):
        """1 / x in float32 (simulator version; a plain Python division, then rounded: an
        ``np.errstate`` block for the zero case would cost several times the division)."""
        x = float(x)
        return np.float32(1.0 / x) if x != 0.0 else np.float32(math.copysign(math.inf, x))

else:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    def _f32_instruction(name, instruction):
        """An intrinsic ``name(x)``: the float32 result of the one-operand PTX ``instruction`` on x."""

        @intrinsic
        def op(typingctx, x):
            if x != types.float32:
                raise TypingError(f"{name}: expected float32, got {x}")
            sig = types.float32(types.float32)

            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.FloatType()]), f"{instruction} $0, $1;", "=f,f")
                return builder.call(asm, args)

            return sig, codegen

        return op

    exp2_approx = _f32_instruction("exp2_approx", "ex2.approx.ftz.f32")  # 2^x
    # 1 / x; without .ftz a reciprocal below 2^-126 stays a subnormal instead of 0, so
    # silu(-88) = -88 / exp(88) keeps its value
    rcp_approx = _f32_instruction("rcp_approx", "rcp.approx.f32")
