"""CPU atomics for numba nopython code.

numba has no CPU atomics of its own, so these are `numba.extending.intrinsic`s
that emit LLVM atomic instructions through llvmlite's IRBuilder. On x86-64 an
acquire load and a release store compile to plain moves (the hardware is TSO),
compare-and-swap to `lock cmpxchg` and fetch-add to `lock xadd` (also a full
barrier: the rings use it where the Dekker pattern needs one). They act on an
element of a numpy array, which may live in shared memory: they hold across
processes, not only across threads.

A spin on a plain array load may be hoisted out of its loop by LLVM and never
see another process's store; spin on `load_acquire` and call `cpu_pause()` in
the loop (the `llvm.x86.sse2.pause` intrinsic; inline asm aborts the process).

| function                      | LLVM                       | returns          |
|-------------------------------|----------------------------|------------------|
| load_acquire(a, i)            | load atomic acquire        | a[i]             |
| load_relaxed(a, i)            | load atomic monotonic      | a[i]             |
| store_release(a, i, v)        | store atomic release       | nothing          |
| compare_and_swap(a, i, old, new) | cmpxchg acq_rel acquire | value seen       |
| fetch_add(a, i, v)            | atomicrmw add acq_rel      | value before     |
| exchange(a, i, v)             | atomicrmw xchg acq_rel     | value before     |
| fence_release()               | fence release              | nothing          |
| fence_acquire()               | fence acquire              | nothing          |
| cpu_pause()                   | llvm.x86.sse2.pause        | nothing          |
| memcpy(dst, i, src, j, n)     | llvm.memcpy                | nothing          |
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _check_array(arr, idx) -> None:
    if not isinstance(arr, types.Array):
        raise TypeError("atomics act on a numpy array element")
    if not isinstance(arr.dtype, types.Integer):
        raise TypeError("atomics act on integer arrays only")
    if not isinstance(idx, types.Integer):
        raise TypeError("atomic index must be an integer")


def _element_pointer(context, builder, arrty, arr, idxty, idx):
    ary = context.make_array(arrty)(context, builder, arr)
    index = context.cast(builder, idx, idxty, types.intp)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [index], wraparound=False)


def _align(context, arrty) -> int:
    return context.get_abi_sizeof(context.get_data_type(arrty.dtype))


def _load(ordering: str):
    def typer(typingctx, arr, idx):
        _check_array(arr, idx)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            return builder.load_atomic(ptr, ordering, _align(context, sig.args[0]))

        return arr.dtype(arr, idx), codegen

    typer.__name__ = f"load_{ordering}"
    return intrinsic(typer)


load_acquire = _load("acquire")
load_relaxed = _load("monotonic")


@intrinsic
def store_release(typingctx, arr, idx, val):
    _check_array(arr, idx)

    def codegen(context, builder, sig, args):
        arrty = sig.args[0]
        ptr = _element_pointer(context, builder, arrty, args[0], sig.args[1], args[1])
        value = context.cast(builder, args[2], sig.args[2], arrty.dtype)
        builder.store_atomic(value, ptr, "release", _align(context, arrty))
        return context.get_dummy_value()

    return types.void(arr, idx, val), codegen


@intrinsic
def compare_and_swap(typingctx, arr, idx, expected, desired):
    _check_array(arr, idx)

    def codegen(context, builder, sig, args):
        arrty = sig.args[0]
        ptr = _element_pointer(context, builder, arrty, args[0], sig.args[1], args[1])
        cmp = context.cast(builder, args[2], sig.args[2], arrty.dtype)
        new = context.cast(builder, args[3], sig.args[3], arrty.dtype)
        pair = builder.cmpxchg(ptr, cmp, new, "acq_rel", "acquire")
        return builder.extract_value(pair, 0)

    return arr.dtype(arr, idx, expected, desired), codegen


def _rmw(op: str):
    def typer(typingctx, arr, idx, val):
        _check_array(arr, idx)

        def codegen(context, builder, sig, args):
            arrty = sig.args[0]
            ptr = _element_pointer(context, builder, arrty, args[0], sig.args[1], args[1])
            value = context.cast(builder, args[2], sig.args[2], arrty.dtype)
            return builder.atomic_rmw(op, ptr, value, "acq_rel")

        return arr.dtype(arr, idx, val), codegen

    typer.__name__ = f"atomic_{op}"
    return intrinsic(typer)


fetch_add = _rmw("add")
exchange = _rmw("xchg")


def _fence(ordering: str):
    def typer(typingctx):
        def codegen(context, builder, sig, args):
            builder.fence(ordering)
            return context.get_dummy_value()

        return types.void(), codegen

    typer.__name__ = f"fence_{ordering}"
    return intrinsic(typer)


fence_release = _fence("release")
fence_acquire = _fence("acquire")


@intrinsic
def cpu_pause(typingctx):
    def codegen(context, builder, sig, args):
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def memcpy(typingctx, dst, dst_index, src, src_index, count):
    """Copy `count` elements src[src_index:] -> dst[dst_index:] with llvm.memcpy (no overlap, no bounds check)."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)):
        raise TypeError("memcpy acts on arrays")
    if dst.dtype != src.dtype:
        raise TypeError("memcpy needs arrays of one dtype")
    if dst.layout != "C" or src.layout != "C":
        raise TypeError("memcpy needs C-contiguous arrays (a strided view would be copied as if dense)")

    def codegen(context, builder, sig, args):
        dst_ty, dst_idx_ty, src_ty, src_idx_ty, count_ty = sig.args
        dst_ptr = _element_pointer(context, builder, dst_ty, args[0], dst_idx_ty, args[1])
        src_ptr = _element_pointer(context, builder, src_ty, args[2], src_idx_ty, args[3])
        n = context.cast(builder, args[4], count_ty, types.intp)
        cgutils.raw_memcpy(builder, dst_ptr, src_ptr, n, _align(context, dst_ty))
        return context.get_dummy_value()

    return types.void(dst, dst_index, src, src_index, count), codegen
