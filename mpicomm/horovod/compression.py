"""Gradient compression for allreduce: Horovod's ``Compression.none`` and ``fp16``, and
``onebit`` (mpicomm's 1-bit allreduce with error feedback, for DistributedOptimizer)."""
from __future__ import annotations

import torch


class Compressor:
    """Compress a tensor before the allreduce, decompress the result."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        """(compressed tensor, context for decompress)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 and come back in their dtype; others unchanged."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None or not ctx.is_floating_point else tensor.type(ctx)


class OnebitCompressor(NoneCompressor):
    """Marker for DistributedOptimizer: gradients go through ``compressed.OnebitAllreduce``
    (1 bit per element and a scale, error feedback on worker and server). As a plain
    compress/decompress pair (hvd.allreduce(compression=...)) it sends full precision, as
    ``NoneCompressor``."""


class Compression:
    """The compressors of ``compression=``."""
    none = NoneCompressor
    fp16 = FP16Compressor
    onebit = OnebitCompressor
