"""CRC32C (Castagnoli) inside numba kernels.

Outside kernels the project uses the `crc32c` package (hardware CRC32C); a
kernel cannot call it, so this computes the same checksum in nopython code:
eight bytes per `crc32` instruction (SSE4.2, `llvm.x86.sse42.crc32.64.64`) on
x86-64, a table otherwise. Tested against the `crc32c` package.

`crc32c_update(crc, data_u8, start, stop)` continues a running CRC over
data_u8[start:stop] (pre/post-inversion as the standard defines: start with
crc32c_init(), finish with crc32c_final()).
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..jit import kernel

_X86 = platform.machine().lower() in ("x86_64", "amd64")
POLY_REFLECTED = 0x82F63B78


def _table() -> np.ndarray:
    table = np.zeros(256, np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ POLY_REFLECTED if c & 1 else c >> 1
        table[i] = c
    return table


TABLE = _table()


@intrinsic
def _crc32_u64(typingctx, crc, word):
    """One `crc32 r64, r64` step (x86-64 SSE4.2)."""

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64, i64]), "llvm.x86.sse42.crc32.64.64")
        return builder.call(fn, [args[0], args[1]])

    return types.uint64(types.uint64, types.uint64), codegen


@kernel
def crc32c_init():
    return np.uint32(0xFFFFFFFF)


@kernel
def crc32c_final(crc):
    return np.uint32(crc ^ np.uint32(0xFFFFFFFF))


@kernel
def _bytes_update(crc, data, start, stop):
    table = TABLE
    c = np.uint32(crc)
    for i in range(start, stop):
        c = table[(c ^ data[i]) & 0xFF] ^ (c >> np.uint32(8))
    return np.uint32(c)


if _X86:

    @kernel
    def crc32c_update(crc, data, start, stop):
        """Continue `crc` over data[start:stop] (data: uint8 array, C-contiguous)."""
        i = start
        c = np.uint32(crc)
        # bytes up to an 8-byte boundary of the index, then whole words, then the rest
        head = min(stop, (start + 7) & ~7)
        c = _bytes_update(c, data, i, head)
        i = head
        if stop - i >= 8:
            words = data[i : i + ((stop - i) & ~7)].view(np.uint64)
            c64 = np.uint64(c)
            for w in range(words.size):
                c64 = _crc32_u64(c64, words[w])
            c = np.uint32(c64)
            i += words.size * 8
        return _bytes_update(c, data, i, stop)

else:

    @kernel
    def crc32c_update(crc, data, start, stop):
        """Continue `crc` over data[start:stop] (data: uint8 array, C-contiguous)."""
        return _bytes_update(crc, data, start, stop)


@kernel
def crc32c(data):
    """CRC32C of a whole uint8 array."""
    return crc32c_final(crc32c_update(crc32c_init(), data, 0, data.size))
